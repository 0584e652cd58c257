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

from collections.abc import Sequence

import torch

from pd_transfer import cuda_ipc
from pd_transfer.client import allocate_pools
from pd_transfer.integrations.vllm.memory import KvMemory


class StagedPages:
    """Shared-memory twins of a rank's KV storages, and the block copies in and out of them."""

    def __init__(self, memory: KvMemory, owner_id: str) -> None:
        self.memory = memory
        self.pools = allocate_pools(memory.geometry, owner_id)
        twins = {rid: t for rid, t in self.pools.tensors.items()}
        self._pairs = []   # (vLLM tensor, its twin, page axis)
        for layer in memory.layers:
            t = layer.tensor
            base = twins[layer.region].view(t.dtype)
            twin = torch.as_strided(base, t.size(), t.stride(), t.storage_offset())
            self._pairs.append((t, twin, layer.page_axis))

    @property
    def handles(self) -> dict[str, str]:
        return self.pools.handles

    def stage(self, block_ids: Sequence[int]) -> None:
        """Prefill: copy these blocks of every layer from vLLM's KV into the twins."""
        self._copy(block_ids, to_twin=True)

    def unstage(self, block_ids: Sequence[int]) -> None:
        """Decode: copy these blocks of every layer from the twins into vLLM's KV."""
        self._copy(block_ids, to_twin=False)

    def _copy(self, block_ids: Sequence[int], *, to_twin: bool) -> None:
        if not block_ids:
            return
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        for kv, twin, axis in self._pairs:
            src, dst = (kv, twin) if to_twin else (twin, kv)
            dst.index_copy_(axis, index, src.index_select(axis, index))

    def close(self) -> None:
        self._pairs = []
        self.pools.close()


class DirectPages:
    """GPU: the storages are shared with the sidecar as they are; nothing to copy."""

    def __init__(self, memory: KvMemory) -> None:
        self.handles = {rid: cuda_ipc.share(t) for rid, t in memory.storages.items()}

    def stage(self, block_ids: Sequence[int]) -> None:
        torch.cuda.synchronize()   # the forward pass's writes are visible to the sidecar's stream

    def unstage(self, block_ids: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        self.handles = {}
