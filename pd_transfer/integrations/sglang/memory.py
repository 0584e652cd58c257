"""Where SGLang's pool tensors live, so that a sidecar can reach them.

A sidecar reads and writes a worker's pools in place. On a GPU the pools are
CUDA tensors, shared with the sidecar as CUDA IPC handles; on CPU (tests,
demos) SGLang's pools are ordinary process memory, so
:func:`share_engine_memory` moves each pool tensor into a POSIX
shared-memory segment first (same shape, dtype and strides; the pool object
then holds the shared tensor). Either way the result is an
:class:`EngineMemory`: every registrable tensor with its region id and what
it is (pool, name, layer), and :meth:`EngineMemory.locate` to turn one of
SGLang's raw ``kv_args`` pointers back into a region and an offset.

Imports torch and SGLang's pool classes only through the objects it is
given; never the agent.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.memory import cuda_ipc
from pd_transfer.memory.segments import Segment, create_segment, segment_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolTensor:
    """One registrable tensor: the region of its backing storage and what SGLang keeps in it.

    SGLang allocates several tensors in one storage (every layer's K and V
    of an MHA pool side by side), so a region is a storage and a tensor sits
    at ``offset_nbytes`` in it.
    """

    region: str  # e.g. "kv.k.0" (the storage's first tensor), "mamba.conv0", "aux.output_ids"
    tensor: Any  # torch.Tensor (CPU in shared memory, or CUDA)
    kind: str  # "k", "v", "kv" (MLA latent), "swa_k", "swa_v", "conv", "temporal", "aux",
    # "host_kv" (a host pool's K and V), "host_k", "host_v", "host_conv",
    # "host_temporal", "draft_k", "draft_v", "draft_kv" (the speculative draft model's KV)
    index: int  # layer position in its pool (aux: position in MetadataBuffers)
    layer_id: int | None = None  # the model layer, where the pool maps positions to layers

    @property
    def base_ptr(self) -> int:
        return self.tensor.untyped_storage().data_ptr()

    @property
    def offset_nbytes(self) -> int:
        return self.tensor.storage_offset() * self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region (the storage)."""
        return self.tensor.untyped_storage().nbytes()

    @property
    def span_nbytes(self) -> int:
        """Bytes from the tensor's first element to one past its last."""
        last = sum((n - 1) * s for n, s in zip(self.tensor.shape, self.tensor.stride()))
        return (last + 1) * self.tensor.element_size()


@dataclass(frozen=True)
class HostKvPool:
    """What a host (HiCache) KV pool's buffers alone do not say: their layout and extents."""

    layout: str  # SGLang's --hicache-mem-layout: layer_first, page_first, ...
    page_size: int
    layer_num: int


@dataclass
class EngineMemory:
    """Every registrable tensor of one SGLang rank, and how the sidecar opens it."""

    tensors: list[PoolTensor] = field(default_factory=list)
    segments: dict[str, Segment] = field(default_factory=dict)  # CPU only
    host: HostKvPool | None = None  # decode's KV destination when it is a host (HiCache) pool

    @property
    def handles(self) -> dict[str, str]:
        """Region id -> shm segment name (CPU) or CUDA IPC handle (GPU)."""
        out = {}
        for entry in self.tensors:
            if entry.region in out:
                continue
            segment = self.segments.get(entry.region)
            out[entry.region] = (
                segment.name if segment is not None else cuda_ipc.share(_whole_storage(entry.tensor))
            )
        return out

    def locate(self, ptr: int, nbytes: int, what: str) -> tuple[PoolTensor, int]:
        """The tensor holding ``[ptr, ptr + nbytes)`` and the byte offset of ``ptr`` in it."""
        for entry in self.tensors:
            offset = ptr - entry.base_ptr
            inside = offset - entry.offset_nbytes
            if 0 <= inside and inside + nbytes <= entry.span_nbytes:
                return entry, offset
        raise GeometryError(
            f"{what}: SGLang registered {nbytes} bytes at 0x{ptr:x}, which lie in no pool tensor "
            f"pd-transfer was given",
            code=Reason.BAD_VIEW,
            hint="load the pd_transfer SGLang plugin before the scheduler builds its KV manager",
        )

    def close(self) -> None:
        """Unlink the shared-memory names (CPU); the pools keep their mappings."""
        for segment in self.segments.values():
            segment.unlink()
        self.segments.clear()


def share_engine_memory(
    owner_id: str,
    *,
    kv_pool: Any,
    metadata_buffers: Any,
    mamba_pool: Any | None = None,
    host_kv_pool: Any | None = None,
    host_mamba_pool: Any | None = None,
    draft_kv_pool: Any | None = None,
) -> EngineMemory:
    """Collect (and on CPU, move into shared memory) every tensor a transfer touches.

    ``kv_pool`` is SGLang's ``token_to_kv_pool`` (MHA, MLA, SWA or hybrid
    linear pool), ``metadata_buffers`` its ``MetadataBuffers``, ``mamba_pool``
    the ``MambaPool`` of a hybrid model. ``host_kv_pool`` (decode only), an
    ``MHATokenToKVPoolHost`` or ``AsymmetricMHATokenToKVPoolHost``, makes the
    host pool the KV destination instead of the device pool, and
    ``host_mamba_pool`` (a ``MambaPoolHost``) the Mamba state's. On CPU their
    buffers are re-pointed like the device pools'; pointer tables the host
    pool built at construction (``k_data_ptrs``) keep the old addresses,
    which only its GPU copy kernels read. ``draft_kv_pool`` is the
    speculative draft model's KV pool (SGLang's ``draft_token_to_kv_pool``:
    EAGLE, EAGLE3 and standalone drafts keep an MHA pool, DeepSeek's MTP an
    MLA pool); its pages share the target's page indices.
    """
    if host_kv_pool is not None and hasattr(host_kv_pool, "kv_lora_rank"):  # before any segment
        raise GeometryError(
            f"host.kv: {type(host_kv_pool).__name__} (an MLA host pool) as decode's KV destination "
            "is not supported by pd-transfer's SGLang backend: it addresses MHA host pools' K and V "
            "heads, not an MLA latent",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="register decode's device pools (the plugin's queue hook does)",
        )
    memory = EngineMemory()
    if host_kv_pool is not None:
        memory.host = HostKvPool(
            str(host_kv_pool.layout), int(host_kv_pool.page_size), int(host_kv_pool.layer_num)
        )
    owner = f"{owner_id}-{os.getpid()}"
    moved: dict[int, tuple[str, Any]] = {}  # old storage pointer -> (region, shared uint8 storage)
    try:
        layers = _global_layers(kv_pool)
        tensors = _pool_tensors(kv_pool, mamba_pool, metadata_buffers, host_kv_pool, host_mamba_pool)
        for kind, index, holder, attr, position in itertools.chain(tensors, _draft_tensors(draft_kv_pool)):
            tensor = _get(holder, attr, position)
            storage_ptr = tensor.untyped_storage().data_ptr()
            if storage_ptr not in moved:
                region = f"aux.{attr}" if kind == "aux" else f"{_REGION_PREFIX[kind]}.{index}"
                shared = _move_to_shm(memory, owner, region, tensor) if tensor.device.type == "cpu" else None
                moved[storage_ptr] = (region, shared)
            region, shared = moved[storage_ptr]
            if shared is not None:
                _rebind(tensor, shared)
            layer_id = layers.get((kind.startswith("swa_"), index)) if kind in _KV_KINDS else None
            memory.tensors.append(PoolTensor(region, tensor, kind, index, layer_id))
    except BaseException:
        memory.close()
        raise
    return memory


_REGION_PREFIX = {
    "k": "kv.k",
    "v": "kv.v",
    "kv": "kv.latent",
    "swa_k": "swa.k",
    "swa_v": "swa.v",
    "conv": "mamba.conv",
    "temporal": "mamba.temporal",
    "host_kv": "host.kv",
    "host_k": "host.k",
    "host_v": "host.v",
    "host_conv": "host.mamba.conv",
    "host_temporal": "host.mamba.temporal",
    "draft_k": "draft.k",
    "draft_v": "draft.v",
    "draft_kv": "draft.latent",
}


_KV_KINDS = ("k", "v", "kv", "swa_k", "swa_v")


def _global_layers(kv_pool: Any) -> dict[tuple[bool, int], int]:
    """``(is_swa, position in its sub-pool) -> model layer`` where the pool says so.

    An SWA pool interleaves full-attention and sliding-window layers
    (``layers_mapping[layer] = (position, is_swa)``); SGLang's ``kv_args``
    carry no layer ids for its window pages.
    """
    mapping = getattr(kv_pool, "layers_mapping", None) or {}
    return {(bool(is_swa), int(position)): int(layer) for layer, (position, is_swa) in mapping.items()}


def _pool_tensors(
    kv_pool: Any,
    mamba_pool: Any | None,
    metadata_buffers: Any,
    host_kv_pool: Any | None,
    host_mamba_pool: Any | None,
):
    """``(kind, index, holder, attribute, list position or None)`` of every tensor."""
    full = getattr(kv_pool, "full_kv_pool", kv_pool)
    if hasattr(full, "kv_buffer"):  # MLA
        for i in range(len(full.kv_buffer)):
            yield "kv", i, full, "kv_buffer", i
    else:
        for i in range(len(full.k_buffer)):
            yield "k", i, full, "k_buffer", i
            yield "v", i, full, "v_buffer", i
    swa = getattr(kv_pool, "swa_kv_pool", None)
    if swa is not None:
        for i in range(len(swa.k_buffer)):
            yield "swa_k", i, swa, "k_buffer", i
            yield "swa_v", i, swa, "v_buffer", i
    if mamba_pool is not None:
        cache = mamba_pool.mamba_cache
        for i in range(len(cache.conv)):
            yield "conv", i, cache, "conv", i
        yield "temporal", 0, cache, "temporal", None
    if host_kv_pool is not None:
        if isinstance(host_kv_pool.kv_buffer, (tuple, list)):  # head_dim != v_head_dim: K and V apart
            yield "host_k", 0, host_kv_pool, "kv_buffer", 0
            yield "host_v", 0, host_kv_pool, "kv_buffer", 1
        else:  # (2, ...): K then V
            yield "host_kv", 0, host_kv_pool, "kv_buffer", None
    if host_mamba_pool is not None:  # (slots, Lm, 1, *state shape)
        for i in range(len(host_mamba_pool.conv_buffer)):
            yield "host_conv", i, host_mamba_pool, "conv_buffer", i
        yield "host_temporal", 0, host_mamba_pool, "temporal_buffer", None
    for position, name in enumerate(_aux_names(metadata_buffers)):
        yield "aux", position, metadata_buffers, name, None


def _draft_tensors(draft_kv_pool: Any | None):
    """The draft model's KV buffers, as :func:`_pool_tensors` yields the target's.

    A hybrid draft pool keeps them in its full-attention sub-pool; a draft
    with sliding-window layers is refused by name (its window pages are
    indexed apart from the target's).
    """
    if draft_kv_pool is None:
        return
    if getattr(draft_kv_pool, "swa_kv_pool", None) is not None:
        raise GeometryError(
            f"draft KV pool: SGLang's {type(draft_kv_pool).__name__} (a draft model with "
            f"sliding-window layers) is not supported by pd-transfer's SGLang backend",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="use a draft model without sliding-window attention, or SGLang's mooncake backend",
        )
    full = getattr(draft_kv_pool, "full_kv_pool", draft_kv_pool)
    if hasattr(full, "kv_buffer"):  # MLA (DeepSeek MTP)
        for i in range(len(full.kv_buffer)):
            yield "draft_kv", i, full, "kv_buffer", i
        return
    for i in range(len(full.k_buffer)):
        yield "draft_k", i, full, "k_buffer", i
        yield "draft_v", i, full, "v_buffer", i


def _aux_names(metadata_buffers: Any) -> list[str]:
    """Attribute names of the tensors ``get_buf_infos`` registers, in its order."""
    ptrs = metadata_buffers.get_buf_infos()[0]
    by_ptr = {
        value.data_ptr(): name
        for name, value in vars(metadata_buffers).items()
        if hasattr(value, "data_ptr") and hasattr(value, "nbytes")
    }
    return [by_ptr[ptr] for ptr in ptrs]


def _get(holder: Any, attr: str, position: int | None) -> Any:
    value = getattr(holder, attr)
    return value if position is None else value[position]


def _move_to_shm(memory: EngineMemory, owner: str, region: str, tensor: Any) -> Any:
    """A new shared-memory segment holding a copy of ``tensor``'s whole storage, as uint8."""
    storage = _whole_storage(tensor)
    segment = create_segment(segment_name(owner, region), max(storage.numel(), 1))
    memory.segments[region] = segment
    shared = segment.tensor[: storage.numel()]
    shared.copy_(storage)
    return shared


def _whole_storage(tensor: Any) -> Any:
    """``tensor``'s whole storage as a flat uint8 tensor (same memory)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _rebind(tensor: Any, shared: Any) -> None:
    """Point ``tensor`` itself at the shared storage, same offset, shape and strides.

    In place, so every holder of the tensor object (lists, frozen dataclasses
    such as ``MambaPool.State``) sees the shared memory without being patched.
    """
    tensor.set_(shared.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
