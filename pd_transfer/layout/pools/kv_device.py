"""Device KV pools: one buffer per layer per tensor, in NHD or HND order.

SGLang's ``MHATokenToKVPool`` keeps, per layer, a K buffer and a V buffer of
``[num_pages * page_size, H, D]`` (NHD; HND is ``[num_pages, H, page_size,
D]``); its MLA pool keeps one latent buffer per layer. Each buffer here is its
own region, ``<prefix>.<name>.L<layer_id>`` (``kv.k.L3``), exactly as large
as the view. An MLA latent has no head axis, so NHD and HND are the same bytes.

Pure; imports the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.errors import ConfigError
from pd_transfer.layout.geometry import Region
from pd_transfer.layout.pools.attention import KvPoolShape, KvTensor, buffer_sizes, kv_view
from pd_transfer.layout.pools.memory_order import (
    DEVICE_KV_LAYOUTS,
    HEAD,
    KV_ORDER,
    element_strides,
    num_elements,
    without,
)
from pd_transfer.layout.pools.pool_views import PoolViews


def place_device(tensors: Sequence[KvTensor], grid: KvPoolShape, region_prefix: str) -> PoolViews:
    """One region per tensor, each holding one layer's K, V or latent buffer."""
    if grid.layout not in DEVICE_KV_LAYOUTS:
        raise ConfigError(
            f"kv_layout {grid.layout.value!r} is not a device layout; "
            f"device pools accept {[option.value for option in DEVICE_KV_LAYOUTS]}"
        )
    views, regions = [], []
    for tensor in tensors:
        order = KV_ORDER[grid.layout]
        if tensor.shard is None:
            order = without(order, HEAD)
        num_heads = 1 if tensor.shard is None else tensor.shard.local_extent
        sizes = buffer_sizes(grid, num_layers=1, num_heads=num_heads, dim=tensor.dim)
        region_id = f"{region_prefix}.{tensor.name}.L{tensor.layer_id}"
        views.append(
            kv_view(
                tensor, grid, region=region_id, offset_elems=0, strides_elems=element_strides(order, sizes)
            )
        )
        regions.append(Region(region_id, num_elements(order, sizes) * grid.itemsize))
    return PoolViews(tuple(views), tuple(regions))
