"""CPU staging: vLLM's KV is process memory the sidecar cannot map, so pages go through shared memory.

On CPU, vLLM allocates its KV cache as ordinary tensors. The connector
allocates one shared-memory segment per backing storage, of the same size,
and registers those with the sidecar under the same views: the segment is a
byte-for-byte twin of the storage. Prefill copies a request's blocks into the
twin before ``send``; decode copies them out of the twin once the room
succeeded. The cost: one extra copy of the request's pages on each side, and
the KV cache's size again in shared memory.

On a GPU the storages themselves are shared with CUDA IPC and nothing is
staged (:class:`DirectPages`).

Imports torch, the client and the layout layer; never vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pd_transfer.client import allocate_pools
from pd_transfer.integrations.vllm.memory import KvMemory
from pd_transfer.layout.views import Pool
from pd_transfer.memory import cuda_ipc

Blocks = Mapping[Pool, Sequence[int]]  # a request's blocks per pool (KV pages, SWA pages, state slots)


class StagedPages:
    """Shared-memory twins of a rank's KV storages, and the block copies in and out of them."""

    def __init__(self, memory: KvMemory, owner_id: str) -> None:
        self.memory = memory
        self.pools = allocate_pools(memory.geometry, owner_id)
        twins = {rid: t for rid, t in self.pools.tensors.items()}
        self._pairs = []  # (vLLM tensor, its twin, page axis, pool)
        for layer in memory.layers:
            t = layer.tensor
            base = twins[layer.region].view(t.dtype)
            twin = torch.as_strided(base, t.size(), t.stride(), t.storage_offset())
            self._pairs.append((t, twin, layer.page_axis, layer.pool))

    @property
    def handles(self) -> dict[str, str]:
        return self.pools.handles

    def stage(self, blocks: Blocks, layer_id: int | None = None) -> None:
        """Prefill: copy these blocks of every layer (or of ``layer_id``) from vLLM's KV into the twins."""
        self._copy(blocks, to_twin=True, layer_id=layer_id)

    def unstage(self, blocks: Blocks) -> None:
        """Decode: copy these blocks of every layer from the twins into vLLM's KV."""
        self._copy(blocks, to_twin=False)

    def _copy(self, blocks: Blocks, *, to_twin: bool, layer_id: int | None = None) -> None:
        index = {pool: torch.as_tensor(list(ids), dtype=torch.long) for pool, ids in blocks.items() if ids}
        for layer, (kv, twin, axis, pool) in zip(self.memory.layers, self._pairs):
            if pool not in index or layer_id is not None and layer.layer_id != layer_id:
                continue
            src, dst = (kv, twin) if to_twin else (twin, kv)
            dst.index_copy_(axis, index[pool], src.index_select(axis, index[pool]))

    def close(self) -> None:
        self._pairs = []
        self.pools.close()


class DirectPages:
    """GPU: the storages are shared with the sidecar as they are; nothing to copy."""

    def __init__(self, memory: KvMemory) -> None:
        self.handles = {rid: cuda_ipc.share(t) for rid, t in memory.storages.items()}

    def stage(self, blocks: Blocks, layer_id: int | None = None) -> None:
        torch.cuda.synchronize()  # the forward pass's writes are visible to the sidecar's stream

    def unstage(self, blocks: Blocks) -> None:
        pass

    def close(self) -> None:
        self.handles = {}
