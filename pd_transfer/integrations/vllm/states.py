"""vLLM's Mamba/GDN layer state described as pd-transfer views: one slot per state block.

vLLM hands ``register_kv_caches`` a linear-attention layer (Mamba1, Mamba2,
gated delta net) as ONE raw ``[blocks, 1, 1, C]`` int8 view: each block's
``C`` bytes hold the layer's states packed one after the other, in the order
and with the shapes and dtypes of its ``MambaSpec`` (``shapes``, ``dtypes``),
and the block stride may be larger than ``C`` (a page padded to the
attention page, or other layers' pages in between). A block of that group
is a state slot (``Pool.MAMBA``): a request's state lives in one block.

Each state becomes one view, sliced out of the page at its byte offset:

    conv      (state_len, channels)   "SD" layout (vLLM's default)
              (channels, state_len)   "DS" layout
    temporal  (heads, ...)            GDN (v_heads, v_dim, k_dim); Mamba2 (heads, head_dim, state)

The channels and heads are this rank's share: the sharded axis. A conv
state's channels are several projections concatenated (GDN ``q | k | v``,
Mamba2 ``x | B | C``), each split across TP on its own, so the connector
passes the global split as ``conv_groups`` and each rank holds its slice of
every group. A replicated state (``tp_replicated``) has no sharded axis.

Imports torch and the layout layer; never vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pd_transfer.errors import ConfigError
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView

SLOT_AXIS = Axis("slot", AxisRole.INDEX)


@dataclass(frozen=True)
class StateSpec:
    """What vLLM's ``MambaSpec`` says of one linear-attention layer (local to this rank).

    ``shapes``/``dtypes``: the states in page order, first the conv state.
    ``conv_groups``: the global split of the conv channels (None: one group).
    ``conv_dim_first``: the conv state is ``(channels, state_len)`` ("DS").
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    conv_groups: tuple[int, ...] | None = None
    conv_dim_first: bool = False
    tp_replicated: bool = False


def state_views(
    name: str,
    layer_id: int,
    tensor: torch.Tensor,
    spec: StateSpec,
    region: str,
    tp_size: int,
    tp_rank: int,
    dtype_names: dict,
) -> list[TensorView]:
    """One view per state of a ``[blocks, 1, 1, C]`` int8 layer tensor (see the module docstring)."""
    if tensor.dim() != 4 or tensor.shape[1:3] != (1, 1) or tensor.element_size() != 1:
        raise ConfigError(
            f"vLLM layer {name!r}: Mamba state tensor of shape {list(tensor.shape)} "
            f"and dtype {tensor.dtype}; expected a raw [blocks, 1, 1, bytes] int8 page view"
        )
    if len(spec.shapes) != len(spec.dtypes) or not spec.shapes:
        raise ConfigError(
            f"vLLM layer {name!r}: MambaSpec declares {len(spec.shapes)} state shapes "
            f"and {len(spec.dtypes)} dtypes; expected one dtype per state"
        )
    sizes = [math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in zip(spec.shapes, spec.dtypes)]
    if sum(sizes) > tensor.shape[3] or tensor.stride(3) != 1:
        raise ConfigError(
            f"vLLM layer {name!r}: its states take {sum(sizes)} bytes per block, the page "
            f"view holds {tensor.shape[3]} (stride {tensor.stride(3)})"
        )
    base = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
    views, offset = [], 0
    for i, (shape, dtype, size) in enumerate(zip(spec.shapes, spec.dtypes, sizes)):
        kind = "conv" if i == 0 else "temporal"
        axes, shard = _state_axes(name, kind, shape, spec, tp_size, tp_rank)
        isz = torch.empty(0, dtype=dtype).element_size()
        inner = [isz * math.prod(shape[d + 1 :]) for d in range(len(shape))]
        dtype_name = dtype_names.get(dtype)
        if dtype_name is None:
            raise ConfigError(f"vLLM layer {name!r}: state dtype {dtype} is not supported")
        views.append(
            TensorView(
                pool=Pool.MAMBA,
                layer_id=layer_id,
                name=kind if i < 2 else f"state{i}",
                region=region,
                offset_nbytes=base + offset,
                dtype=dtype_name,
                shape=(tensor.shape[0],) + tuple(shape),
                strides_nbytes=(tensor.stride(0),) + tuple(inner),
                axes=(SLOT_AXIS,) + axes,
                shard=shard,
                layout=Layout.SLOT,
            )
        )
        offset += size
    return views


def _state_axes(
    name: str, kind: str, shape: tuple[int, ...], spec: StateSpec, tp_size: int, tp_rank: int
) -> tuple[tuple[Axis, ...], ShardSpec | None]:
    """Axes of one slot of a state, and the shard of its TP-split axis."""
    if spec.tp_replicated:
        return tuple(Axis(f"d{i}", AxisRole.INNER) for i in range(len(shape))), None
    if kind == "conv":
        if len(shape) != 2:
            raise ConfigError(f"vLLM layer {name!r}: conv state of shape {list(shape)}; expected 2 axes")
        axis = 0 if spec.conv_dim_first else 1
        # "tap" is an INNER axis in either order, as SGLang's (channels, taps) conv state names it:
        # the sidecars match axes by name and role, so the two engines' layouts reconcile
        axes: tuple[Axis, ...] = (
            (Axis("channel", AxisRole.SHARD), Axis("tap", AxisRole.INNER))
            if axis == 0
            else (Axis("tap", AxisRole.INNER), Axis("channel", AxisRole.SHARD))
        )
        groups = spec.conv_groups
    else:
        axis, groups = 0, None
        axes = (Axis("head", AxisRole.SHARD),) + tuple(
            Axis(f"d{i}", AxisRole.INNER) for i in range(1, len(shape))
        )
    local = shape[axis]
    shard = (
        ShardSpec.for_rank(sum(groups), tp_size, tp_rank, tuple(groups))
        if groups
        else ShardSpec.for_rank(local * tp_size, tp_size, tp_rank)
    )
    if shard.local_extent != local:
        raise ConfigError(
            f"vLLM layer {name!r}: conv groups {list(groups or [])} over tp size {tp_size} "
            f"give rank {tp_rank} {shard.local_extent} channels, its {kind} state holds {local}"
        )
    return axes, shard
