"""Public KV pool builders: MHA/GQA K and V, and MLA latents, on device or host.

The layout of ``grid`` picks the placement: NHD/HND build per-layer device
buffers (:mod:`.kv_device`), the host layouts one shared buffer
(:mod:`.kv_host`). Every view has the logical axes ``page, token, head,
head_dim`` (``page, token, latent_dim`` for MLA) whatever the layout: only the
strides and offsets differ.

Pure; imports the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.layout.pools.attention import (
    AttentionSpec,
    KvPoolShape,
    KvTensor,
    MlaSpec,
    check_layer_ids,
    kv_head_shard,
)
from pd_transfer.layout.pools.kv_device import place_device
from pd_transfer.layout.pools.kv_host import place_host
from pd_transfer.layout.pools.pool_views import PoolViews
from pd_transfer.layout.views import Pool

MLA_TENSOR = "latent"


def build_kv_pool(
    attn: AttentionSpec,
    layer_ids: Sequence[int],
    grid: KvPoolShape,
    *,
    tp_size: int,
    tp_rank: int,
    pool: Pool = Pool.KV,
    region_prefix: str | None = None,
) -> PoolViews:
    """K and V views of ``layer_ids`` (global ids) for one TP rank.

    ``pool`` is ``Pool.KV`` for full attention and ``Pool.SWA`` for
    sliding-window layers (then ``grid.num_pages`` counts SWA pages).
    """
    ids = check_layer_ids(layer_ids)
    if not ids:
        return PoolViews()
    shard = kv_head_shard(attn, pool, tp_size, tp_rank)
    tensors = [
        KvTensor(pool, name, layer_id, dim, shard) for layer_id in ids for name, dim in attn.head_dims()
    ]
    return _place(tensors, grid, pool, region_prefix)


def build_mla_pool(
    mla: MlaSpec,
    layer_ids: Sequence[int],
    grid: KvPoolShape,
    *,
    pool: Pool = Pool.KV,
    region_prefix: str | None = None,
) -> PoolViews:
    """Latent views of ``layer_ids``: replicated on every TP rank, no head axis."""
    ids = check_layer_ids(layer_ids)
    if not ids:
        return PoolViews()
    tensors = [KvTensor(pool, MLA_TENSOR, layer_id, mla.latent_dim, None) for layer_id in ids]
    return _place(tensors, grid, pool, region_prefix)


def _place(tensors: list[KvTensor], grid: KvPoolShape, pool: Pool, region_prefix: str | None) -> PoolViews:
    if grid.layout.is_host:
        return place_host(tensors, grid, region_prefix or f"{pool.value}_host")
    return place_device(tensors, grid, region_prefix or pool.value)
