"""What one attention layer keeps per token, and how a KV view is made from it.

:class:`AttentionSpec` is MHA/GQA geometry (global KV heads, K and V head
dims, an optional sliding window); :class:`MlaSpec` is an MLA latent;
:class:`KvPoolShape` is where a rank keeps its pages (count, tokens per page,
layout, dtype). :func:`kv_view` turns a buffer's memory order
(:mod:`.memory_order`) into a :class:`TensorView` with the logical axis order
every KV view shares: ``page, token, [head,] dim``.

Pure; imports ``pd_transfer.errors`` and the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pd_transfer.errors import ConfigError
from pd_transfer.layout.dtypes import itemsize
from pd_transfer.layout.pools.checks import require_dtype, require_positive, shard_for_rank
from pd_transfer.layout.pools.memory_order import DIM, HEAD, LAYER, PAGE, TOKEN
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView

PAGE_AXIS = Axis("page", AxisRole.INDEX)
TOKEN_AXIS = Axis("token", AxisRole.TOKEN)
HEAD_AXIS = Axis("head", AxisRole.SHARD)
HEAD_DIM_AXIS = Axis("head_dim", AxisRole.INNER)
LATENT_DIM_AXIS = Axis("latent_dim", AxisRole.INNER)


@dataclass(frozen=True)
class AttentionSpec:
    """MHA/GQA geometry of one kind of attention layer, model-wide (not per rank).

    ``v_head_dim`` None means equal to ``head_dim``; MiMo-V2 has K 192 and
    V 128. ``window_tokens`` is set for sliding-window layers only.
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        require_positive("num_kv_heads", self.num_kv_heads)
        require_positive("head_dim", self.head_dim)
        if self.v_head_dim is not None:
            require_positive("v_head_dim", self.v_head_dim)
        if self.window_tokens is not None:
            require_positive("window_tokens", self.window_tokens)

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def head_dims(self) -> tuple[tuple[str, int], ...]:
        """``(tensor name, head dim)`` of K then V."""
        return (("k", self.head_dim), ("v", self.value_head_dim))


@dataclass(frozen=True)
class MlaSpec:
    """An MLA latent: one replicated "head" of ``kv_lora_rank + qk_rope_head_dim``."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        require_positive("kv_lora_rank", self.kv_lora_rank)
        require_positive("qk_rope_head_dim", self.qk_rope_head_dim)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim  # DeepSeek-V3: 512 + 64 = 576


@dataclass(frozen=True)
class KvPoolShape:
    """One rank's page pool: ``num_pages`` pages of ``page_size`` tokens."""

    num_pages: int
    page_size: int
    layout: Layout
    dtype: str

    def __post_init__(self) -> None:
        require_positive("num_pages", self.num_pages)
        require_positive("page_size", self.page_size)
        require_dtype("kv_dtype", self.dtype)
        if not isinstance(self.layout, Layout):
            raise ConfigError(f"kv_layout must be a Layout, got {self.layout!r}")

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


def check_layer_ids(layer_ids: Sequence[int]) -> tuple[int, ...]:
    """Layer ids as a tuple of distinct non-negative ints, or ConfigError."""
    ids = tuple(layer_ids)
    for layer_id in ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id < 0:
            raise ConfigError(f"layer ids must be non-negative integers, got {layer_id!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"layer ids repeat: {list(ids)}")
    return ids


@dataclass(frozen=True)
class KvTensor:
    """One K, V or latent tensor to place: its name, layer and head geometry."""

    pool: Pool
    name: str
    layer_id: int
    dim: int  # head_dim, v_head_dim or latent_dim
    shard: ShardSpec | None  # None: MLA latent, no head axis


def kv_view(
    tensor: KvTensor, grid: KvPoolShape, *, region: str, offset_elems: int, strides_elems: Mapping[str, int]
) -> TensorView:
    """The view of ``tensor`` in a buffer with the given element strides.

    ``strides_elems`` maps page/token/head/dim (see :mod:`.memory_order`)
    to element strides; the view lists them in logical order.
    """
    isz = grid.itemsize
    names: tuple[str, ...]
    axes: tuple[Axis, ...]
    shape: tuple[int, ...]
    if tensor.shard is None:
        names = (PAGE, TOKEN, DIM)
        axes = (PAGE_AXIS, TOKEN_AXIS, LATENT_DIM_AXIS)
        shape = (grid.num_pages, grid.page_size, tensor.dim)
    else:
        names = (PAGE, TOKEN, HEAD, DIM)
        axes = (PAGE_AXIS, TOKEN_AXIS, HEAD_AXIS, HEAD_DIM_AXIS)
        shape = (grid.num_pages, grid.page_size, tensor.shard.local_extent, tensor.dim)
    return TensorView(
        pool=tensor.pool,
        layer_id=tensor.layer_id,
        name=tensor.name,
        region=region,
        offset_nbytes=offset_elems * isz,
        dtype=grid.dtype,
        shape=shape,
        strides_nbytes=tuple(strides_elems[n] * isz for n in names),
        axes=axes,
        shard=tensor.shard,
        layout=grid.layout,
    )


def buffer_sizes(grid: KvPoolShape, *, num_layers: int, num_heads: int, dim: int) -> dict[str, int]:
    """Sizes of the memory-order dimensions of one buffer."""
    return {LAYER: num_layers, PAGE: grid.num_pages, TOKEN: grid.page_size, HEAD: num_heads, DIM: dim}


def kv_head_shard(attn: AttentionSpec, pool: Pool, tp_size: int, tp_rank: int) -> ShardSpec:
    """This rank's KV heads; fewer heads than ranks replicates one head per rank."""
    section = "sliding_attention" if pool is Pool.SWA else "attention"
    return shard_for_rank(
        f"{section}.num_kv_heads", attn.num_kv_heads, tp_size, tp_rank, allow_replication=True
    )
