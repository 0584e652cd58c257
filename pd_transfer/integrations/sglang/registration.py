"""SGLang's ``kv_args`` and pool tensors as one pd-transfer rank registration.

SGLang describes its memory to a transfer backend as raw pointers with byte
lengths (``kv_args``): per KV buffer a pointer, its length and the bytes of
one page; per state tensor the same plus the sharded extent and, for GDN, the
conv groups. That is not enough to move bytes into a differently shaped pool:
head_dim, the state shapes and dtypes, Mamba2's conv groups and the TP size
are missing. :func:`describe_rank` takes them from the pool tensors
themselves (located from each pointer, see :mod:`.memory`) and from
:class:`~.facts.EngineFacts` (SGLang's model config and server args), and
cross-checks every view against SGLang's own item lengths: a disagreement is
a :class:`~pd_transfer.errors.GeometryError` naming the buffer and both
values, never a guess.

Pure translation: no sockets, no sidecar.
"""

from __future__ import annotations

import math
from typing import Any

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.integrations.sglang import kv_entries
from pd_transfer.integrations.sglang.facts import ConvGroups, EngineFacts
from pd_transfer.integrations.sglang.host_views import host_kv_views
from pd_transfer.integrations.sglang.kv_views import check_item, dtype_name, kv_view
from pd_transfer.integrations.sglang.memory import EngineMemory, PoolTensor
from pd_transfer.layout.geometry import RankGeometry, Region, Role
from pd_transfer.layout.views import Axis, AxisRole, Layout, Pool, ShardSpec, TensorView


def describe_rank(kv_args: Any, memory: EngineMemory, facts: EngineFacts, role: Role) -> RankGeometry:
    """One rank's :class:`RankGeometry` from SGLang's ``kv_args`` (see the module docstring)."""
    tp_size = facts.attn_tp_size
    tp_rank = kv_args.engine_rank % tp_size
    page_size = int(kv_args.page_size)
    views: list[TensorView] = []
    if memory.host is not None:
        views += host_kv_views(memory, facts, page_size, tp_rank)
    else:
        views += kv_entries.target_kv_views(kv_args, memory, facts, page_size, tp_rank)
    views += kv_entries.draft_kv_views(kv_args, memory, facts, page_size, tp_rank)
    views += _state_views(kv_args, memory, facts, tp_rank)
    views += _aux_views(kv_args, memory)
    used = {v.region for v in views}
    sizes = {e.region: e.nbytes for e in memory.tensors if e.region in used}
    regions = tuple(Region(region, nbytes) for region, nbytes in sizes.items())
    return RankGeometry(
        role=role,
        tp_size=tp_size,
        tp_rank=tp_rank,
        page_size=page_size,
        views=tuple(views),
        regions=regions,
        pp_rank=int(kv_args.pp_rank),
        model=facts.model,
    )


def _state_views(kv_args: Any, memory: EngineMemory, facts: EngineFacts, tp_rank: int) -> list[TensorView]:
    views = []
    for c, state_type in enumerate(getattr(kv_args, "state_types", None) or []):
        kind = getattr(state_type, "value", state_type)
        if kind == "mamba":
            views += _mamba_views(kv_args, c, memory, facts, tp_rank)
        elif kind == "swa":
            views += _swa_views(kv_args, c, memory, facts, tp_rank)
        else:
            what = _STATE_COMPONENTS.get(kind, "")
            raise GeometryError(
                f"kv_args.state_types[{c}]: state component {kind!r}{f' ({what})' if what else ''} "
                f"is not supported by pd-transfer's SGLang backend: it registers no view of that "
                f"component's buffers, and moving the model without them would leave decode "
                f"without that state",
                code=Reason.LAYOUT_UNSUPPORTED,
                hint="use SGLang's mooncake or nixl backend for this model",
            )
    return views


_STATE_COMPONENTS = {  # SGLang's StateType values registration refuses, by what uses them
    "dsa": "DeepSeek-V3.2 sparse attention's indexer key cache, NSA/DSA",
    "dsa_tail": "DeepSeek-V3.2 sparse attention's compressed-key ring",
    "qsa_pending": "QSA sparse attention",
    "qsa_compressed": "QSA sparse attention",
    "swa_ring": "DeepSeek-V4",
    "c128_state": "DeepSeek-V4",
    "request_row": "DeepSeek-V4",
    "block_scale": "MXFP8 KV block scales",
    "block_scale_swa": "MXFP8 KV block scales",
    "minimax_index_k": "MiniMax sparse attention",
    "minimax_dense_kv": "MiniMax sparse attention",
}


def _swa_views(
    kv_args: Any, c: int, memory: EngineMemory, facts: EngineFacts, tp_rank: int
) -> list[TensorView]:
    views = []
    layer_ids = kv_args.state_layer_ids[c] if kv_args.state_layer_ids else []
    for j, ptr in enumerate(kv_args.state_data_ptrs[c]):
        what = f"kv_args.state_data_ptrs[{c}][{j}]"
        entry, offset = memory.locate(ptr, kv_args.state_data_lens[c][j], what)
        if entry.kind not in ("swa_k", "swa_v"):
            raise GeometryError(f"{what} points into {entry.region}, not an SWA buffer", code=Reason.BAD_VIEW)
        layer_id = (
            layer_ids[j] if layer_ids else entry.layer_id if entry.layer_id is not None else entry.index
        )
        views.append(
            kv_view(
                entry,
                offset,
                layer_id,
                Pool.SWA,
                int(kv_args.page_size),
                tp_rank,
                facts,
                kv_args.state_item_lens[c][j],
                None,
            )
        )
    return views


def _mamba_views(
    kv_args: Any, c: int, memory: EngineMemory, facts: EngineFacts, tp_rank: int
) -> list[TensorView]:
    views = []
    convs = sum(1 for e in memory.tensors if e.kind == "conv")
    for j, ptr in enumerate(kv_args.state_data_ptrs[c]):
        what = f"kv_args.state_data_ptrs[{c}][{j}]"
        item_nbytes = kv_args.state_item_lens[c][j]
        entry, offset = memory.locate(ptr, item_nbytes, what)
        if entry.kind not in ("conv", "temporal"):
            raise GeometryError(f"{what} points into {entry.region}, not a Mamba state", code=Reason.BAD_VIEW)
        layer_id = kv_args.state_layer_ids[c][j]
        name = entry.kind if entry.kind == "temporal" or convs == 1 else f"conv{entry.index}"
        path = f"mamba.layer[{layer_id}].{name}"
        tensor = entry.tensor
        slot_shape = tuple(tensor.shape[2:])
        isz = tensor.element_size()
        check_item(path, "state_item_lens", item_nbytes, math.prod(slot_shape) * isz)
        dim = _entry(kv_args, "state_dim_per_tensor", c, j, 0)
        outer = _entry(kv_args, "state_slice_outer_counts", c, j, 1)
        groups = _entry(kv_args, "state_conv_shard_groups", c, j, None)
        if groups is not None:
            groups = ConvGroups(tuple(int(g) for g in groups))
        elif entry.kind == "conv":
            groups = facts.mamba2_conv_groups
        axes, shard = _state_axes(path, entry.kind, slot_shape, dim, outer, groups, facts, tp_rank)
        where = (
            entry.region,
            offset,
            (tensor.shape[1],) + slot_shape,
            tuple(s * isz for s in tensor.stride()[1:]),
            Layout.SLOT,
        )
        host = _host_state(memory, entry, offset, path)
        views.append(
            TensorView(
                pool=Pool.MAMBA,
                layer_id=layer_id,
                name=name,
                region=(host or where)[0],
                offset_nbytes=(host or where)[1],
                dtype=dtype_name(tensor),
                shape=(host or where)[2],
                strides_nbytes=(host or where)[3],
                axes=(Axis("slot", AxisRole.INDEX),) + axes,
                shard=shard,
                layout=(host or where)[4],
            )
        )
    return views


def _host_state(memory: EngineMemory, entry: PoolTensor, offset: int, path: str) -> tuple | None:
    """Where a host ``MambaPoolHost`` keeps the state ``entry`` holds at ``offset``, if decode registered one.

    The host buffer is ``(slots, Lm, 1, *state shape)`` (SGLang's page_first and
    page_first_direct, the same bytes for one-slot pages); the layer is the one at
    the same position of the device pool.
    """
    host = next(
        (e for e in memory.tensors if e.kind == f"host_{entry.kind}" and e.index == entry.index), None
    )
    if host is None:
        return None
    tensor, buf = entry.tensor, host.tensor
    isz = buf.element_size()
    position = (offset - entry.offset_nbytes) // (tensor.stride()[0] * tensor.element_size())
    if tuple(buf.shape[3:]) != tuple(tensor.shape[2:]) or buf.dtype != tensor.dtype or buf.shape[2] != 1:
        raise GeometryError(
            f"{path}: the host pool's {host.region} holds {tuple(buf.shape[3:])} {buf.dtype} per "
            f"layer and slot, the device pool {tuple(tensor.shape[2:])} {tensor.dtype}",
            code=Reason.BAD_VIEW,
        )
    strides = buf.stride()
    return (
        host.region,
        (buf.storage_offset() + position * strides[1]) * isz,
        (buf.shape[0],) + tuple(buf.shape[3:]),
        tuple(s * isz for s in (strides[0],) + tuple(strides[3:])),
        Layout.PAGE_FIRST,
    )


def _state_axes(
    path: str,
    kind: str,
    slot_shape: tuple[int, ...],
    dim: int,
    outer: int,
    groups: ConvGroups | None,
    facts: EngineFacts,
    tp_rank: int,
) -> tuple[tuple[Axis, ...], ShardSpec | None]:
    """Axes of one slot (slot axis excluded) and the shard of its sliced axis.

    The sliced axis follows ``outer`` rows (1 normally; K-1 taps in front
    for a Kimi conv state): ``prod(slot_shape[:axis]) == outer``.
    """
    if not dim:  # replicated across attention TP
        return tuple(Axis(f"d{i}", AxisRole.INNER) for i in range(len(slot_shape))), None
    axis = 0
    while axis < len(slot_shape) and math.prod(slot_shape[:axis]) < outer:
        axis += 1
    if axis >= len(slot_shape) or math.prod(slot_shape[:axis]) != outer or slot_shape[axis] != dim:
        raise GeometryError(
            f"{path}: SGLang says {outer} outer rows and a sliced extent of {dim}, "
            f"which does not fit the slot shape {list(slot_shape)}",
            code=Reason.BAD_VIEW,
        )
    names = {"conv": "channel", "temporal": "head"}
    axes = tuple(
        Axis("tap" if i < axis else f"d{i}", AxisRole.OUTER if i < axis else AxisRole.INNER)
        if i != axis
        else Axis(names.get(kind, "channel"), AxisRole.SHARD)
        for i in range(len(slot_shape))
    )
    if axis == 0 and kind == "conv" and len(slot_shape) == 2:
        axes = (Axis("channel", AxisRole.SHARD), Axis("tap", AxisRole.INNER))
    tp = facts.attn_tp_size
    if groups is not None:
        shard = groups.shard(tp, tp_rank)
    else:
        shard = ShardSpec.for_rank(dim * tp, tp, tp_rank)
    if shard.local_extent != dim:
        raise GeometryError(
            f"{path}: groups {list(groups.groups if groups else [])} over attn_tp_size {tp} give "
            f"{shard.local_extent} channels on rank {tp_rank}, SGLang holds {dim}",
            code=Reason.BAD_VIEW,
        )
    return axes, shard


def _aux_views(kv_args: Any, memory: EngineMemory) -> list[TensorView]:
    views = []
    for j, ptr in enumerate(kv_args.aux_data_ptrs):
        what = f"kv_args.aux_data_ptrs[{j}]"
        entry, offset = memory.locate(ptr, kv_args.aux_data_lens[j], what)
        tensor = entry.tensor
        name = entry.region.removeprefix("aux.")
        row_nbytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        check_item(f"aux.{name}", "aux_item_lens", kv_args.aux_item_lens[j], row_nbytes)
        isz = tensor.element_size()
        flat = row_nbytes // isz
        views.append(
            TensorView(
                pool=Pool.AUX,
                layer_id=None,
                name=name,
                region=entry.region,
                offset_nbytes=offset,
                dtype=dtype_name(tensor),
                shape=(tensor.shape[0], flat),
                strides_nbytes=(tensor.stride()[0] * isz, isz),
                axes=(Axis("row", AxisRole.INDEX), Axis("elem", AxisRole.INNER)),
                shard=None,
                layout=Layout.ROW,
            )
        )
    return views


def _entry(kv_args: Any, field: str, c: int, j: int, default: Any) -> Any:
    table = getattr(kv_args, field, None) or []
    if c >= len(table) or j >= len(table[c] or []):
        return default
    value = table[c][j]
    return default if value is None else value
