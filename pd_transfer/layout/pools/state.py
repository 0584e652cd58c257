"""Mamba / linear-attention state pools: one slot per request, on device or host.

Each state tensor name (``conv``, ``ssm``/``temporal``, side states) gets one
region holding that tensor for every local linear layer, ``Lm`` of them:

    slot         device, like SGLang MambaPool   (Lm, num_slots, *shape)  region mamba.<name>
    layer_first  host                            (Lm, num_slots, *shape)  region mamba_host.<name>
    page_first   host, like SGLang MambaPoolHost (num_slots, Lm, *shape)  region mamba_host.<name>

A host state "page" is one slot (page_size 1), so ``page_first_direct`` is the
same bytes as ``page_first`` and is accepted as such; ``page_head`` is refused.
Views keep the global layer id; ``p`` below is a layer's position among the
rank's linear layers.

Pure; imports the layout data modules only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout.dtypes import itemsize
from pd_transfer.layout.geometry import Region
from pd_transfer.layout.pools.attention import check_layer_ids
from pd_transfer.layout.pools.checks import require_positive
from pd_transfer.layout.pools.pool_views import PoolViews
from pd_transfer.layout.pools.state_specs import StateTensor
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, TensorView

SLOT_AXIS = Axis("slot", AxisRole.INDEX)
STATE_LAYOUTS = (Layout.SLOT, Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)
_SLOT_MAJOR = (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)


def build_state_pool(
    tensors: Sequence[StateTensor],
    layer_ids: Sequence[int],
    *,
    num_slots: int,
    layout: Layout = Layout.SLOT,
    region_prefix: str | None = None,
) -> PoolViews:
    """Views of every tensor in ``tensors`` for each of ``layer_ids`` (global ids)."""
    ids = check_layer_ids(layer_ids)
    require_positive("num_slots", num_slots)
    if layout not in STATE_LAYOUTS:
        raise ConfigError(
            f"state_layout {layout.value!r} is not supported for state pools; "
            f"accepted: {[option.value for option in STATE_LAYOUTS]}",
            code=Reason.LAYOUT_UNSUPPORTED,
        )
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ConfigError(f"state tensor names repeat: {names}")
    if not ids:
        return PoolViews()
    prefix = region_prefix or ("mamba" if layout is Layout.SLOT else "mamba_host")
    parts = [_place_tensor(t, ids, num_slots, layout, f"{prefix}.{t.name}") for t in tensors]
    return PoolViews.merge(parts)


def _place_tensor(
    tensor: StateTensor, layer_ids: tuple[int, ...], num_slots: int, layout: Layout, region_id: str
) -> PoolViews:
    item = tensor.item_nbytes
    num_layers = len(layer_ids)
    if layout in _SLOT_MAJOR:
        slot_stride, layer_stride = num_layers * item, item  # (S, Lm, *shape)
    else:
        slot_stride, layer_stride = item, num_slots * item  # (Lm, S, *shape)
    inner = _contiguous_strides(tensor.shape, itemsize(tensor.dtype))
    views = tuple(
        TensorView(
            pool=Pool.MAMBA,
            layer_id=layer_id,
            name=tensor.name,
            region=region_id,
            offset_nbytes=position * layer_stride,
            dtype=tensor.dtype,
            shape=(num_slots,) + tensor.shape,
            strides_nbytes=(slot_stride,) + inner,
            axes=(SLOT_AXIS,) + tensor.axes,
            shard=tensor.shard,
            layout=layout,
        )
        for position, layer_id in enumerate(layer_ids)
    )
    return PoolViews(views, (Region(region_id, num_layers * num_slots * item),))


def _contiguous_strides(shape: tuple[int, ...], isz: int) -> tuple[int, ...]:
    strides = []
    stride = isz
    for n in reversed(shape):
        strides.append(stride)
        stride *= n
    return tuple(reversed(strides))
