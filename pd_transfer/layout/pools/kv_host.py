"""Host KV pools: every local layer of a pool in one buffer, in a host layout.

SGLang's HiCache host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``)
keep K and V of all L layers a rank holds in one buffer, with
``S = num_pages * page_size`` tokens:

    layer_first        (2, L, S, H, D)     K of layer p at p*S*H*D elements
    page_first         (2, S, L, H, D)     K of layer p at p*H*D
    page_first_direct  (2, P, L, ps, H, D) K of layer p at p*ps*H*D
    page_head          (2, P, H, ps, L, D) K of layer p at p*D

V starts after all of K (``L*S*H*D`` elements in). ``L`` counts only the
layers this rank registers in this pool and ``p`` is a layer's position among
them; the view keeps the global layer id. When K and V head dims differ
(MiMo-V2: 192/128) K and V get a buffer each, ``<prefix>.k`` and ``<prefix>.v``.
An MLA latent buffer drops the head axis and the leading 2; ``page_head`` is
refused for MLA (SGLang has no such MLA host layout, and without heads it
would only be ``page_first`` under another name).

Pure; imports the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.geometry import Region
from pd_transfer.layout.pools.attention import KvPoolShape, KvTensor, buffer_sizes, kv_view
from pd_transfer.layout.pools.memory_order import (
    HEAD,
    KV_ORDER,
    LAYER,
    element_strides,
    num_elements,
    without,
)
from pd_transfer.layout.pools.pool_views import PoolViews
from pd_transfer.layout.views import HOST_LAYOUTS, Layout

KV_PAIR = "kv"  # the leading axis of size 2 (K, V) of a shared buffer
MLA_HOST_LAYOUTS = (Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)


def place_host(tensors: Sequence[KvTensor], grid: KvPoolShape, region_prefix: str) -> PoolViews:
    """Place per-layer ``tensors`` (all of one pool) into shared host buffers.

    K and V of equal head dims share one buffer ``<prefix>`` with a leading
    K/V axis, an MLA latent has ``<prefix>`` alone; K and V of different head
    dims get ``<prefix>.k`` and ``<prefix>.v``.
    """
    _check_host_layout(tensors, grid.layout)
    by_name: dict[str, list[KvTensor]] = {}
    for tensor in tensors:
        by_name.setdefault(tensor.name, []).append(tensor)
    dims = {group[0].dim for group in by_name.values()}
    if len(dims) == 1:  # K and V of one head dim, or one MLA latent
        return _place_buffer(tuple(by_name.values()), grid, region_prefix)
    parts = [_place_buffer((group,), grid, f"{region_prefix}.{name}") for name, group in by_name.items()]
    return PoolViews.merge(parts)


def _place_buffer(groups: tuple[list[KvTensor], ...], grid: KvPoolShape, region_id: str) -> PoolViews:
    """One region holding each group (all layers of one tensor name) in turn."""
    first = groups[0][0]
    order = KV_ORDER[grid.layout]
    if first.shard is None:
        order = without(order, HEAD)
    num_heads = 1 if first.shard is None else first.shard.local_extent
    sizes = buffer_sizes(grid, num_layers=len(groups[0]), num_heads=num_heads, dim=first.dim)
    if len(groups) > 1:
        order = (KV_PAIR,) + order
        sizes[KV_PAIR] = len(groups)
    strides = element_strides(order, sizes)
    views = []
    for pair_index, group in enumerate(groups):
        if len(group) != len(groups[0]):
            raise ConfigError(f"host buffer {region_id!r}: tensors hold different layer counts")
        base = pair_index * strides.get(KV_PAIR, 0)
        for position, tensor in enumerate(group):
            offset = base + position * strides[LAYER]
            views.append(kv_view(tensor, grid, region=region_id, offset_elems=offset, strides_elems=strides))
    region = Region(region_id, num_elements(order, sizes) * grid.itemsize)
    return PoolViews(tuple(views), (region,))


def _check_host_layout(tensors: Sequence[KvTensor], layout: Layout) -> None:
    if layout not in HOST_LAYOUTS:
        raise ConfigError(
            f"kv_layout {layout.value!r} is not a host layout; host pools "
            f"accept {[option.value for option in HOST_LAYOUTS]}"
        )
    is_mla = any(t.shard is None for t in tensors)
    if is_mla and layout not in MLA_HOST_LAYOUTS:
        raise ConfigError(
            f"kv_layout {layout.value!r} is not supported for an MLA latent pool; "
            f"MLA host pools accept {[option.value for option in MLA_HOST_LAYOUTS]}",
            code=Reason.LAYOUT_UNSUPPORTED,
            hint="page_head splits heads and an MLA latent has none; use page_first_direct",
        )
