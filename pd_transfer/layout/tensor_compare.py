"""Comparing one tensor's two views, prefill's and decode's: dtype, axes, shapes, shard.

:func:`compare_tensors` returns every mismatch of one pair, each with both
sides' values, a stable reason code and a hint; :mod:`.reconcile` pairs the
tensors and gathers the mismatches of all pairs.

Pure; no I/O.
"""

from __future__ import annotations

from pd_transfer.errors import GeometryError, Mismatch, Reason
from pd_transfer.layout import diagnostics
from pd_transfer.layout.views import AxisRole, ShardSpec, TensorView, canonical_range


def compare_tensors(src: TensorView, dst: TensorView, tp_src: int, tp_dst: int) -> list[Mismatch]:
    """Every mismatch between prefill's view ``src`` and decode's ``dst`` of one tensor."""
    found: list[Mismatch] = []
    if src.dtype != dst.dtype:
        found.append(
            Mismatch(
                f"{src.path}.dtype",
                Reason.DTYPE_MISMATCH,
                src.dtype,
                dst.dtype,
                "configure the same KV/state dtype on prefill and decode",
            )
        )
    src_axes = {a.name: a.role for a in src.axes}
    dst_axes = {a.name: a.role for a in dst.axes}
    if src_axes != dst_axes:
        found.append(
            Mismatch(
                f"{src.path}.axes",
                Reason.AXES_MISMATCH,
                ",".join(f"{n}:{r.value}" for n, r in src_axes.items()),
                ",".join(f"{n}:{r.value}" for n, r in dst_axes.items()),
                "both sides must describe the tensor with the same named axes",
            )
        )
        return found
    for i, axis in enumerate(src.axes):
        j = dst.axis_named(axis.name)
        if axis.role in (AxisRole.INNER, AxisRole.OUTER) and src.shape[i] != dst.shape[j]:
            found.append(
                Mismatch(
                    f"{src.path}.{axis.name}",
                    Reason.INNER_SHAPE_MISMATCH,
                    src.shape[i],
                    dst.shape[j],
                    "both sides must serve the same model (same head and state dims)",
                )
            )
    if src.is_sharded:
        found += _compare_shard(src, dst, tp_src, tp_dst)
    return found


def _compare_shard(src: TensorView, dst: TensorView, tp_src: int, tp_dst: int) -> list[Mismatch]:
    """The sharded axis: metadata present where resliced, same model, splittable groups."""
    axis = src.axes[src.axis_of(AxisRole.SHARD)].name
    if src.shard is None or dst.shard is None:
        return _missing_shard_metadata(src, dst, tp_src, tp_dst, axis)
    if src.shard.global_extent != dst.shard.global_extent:
        return [
            Mismatch(
                f"{src.path}.{axis}.global_extent",
                Reason.GLOBAL_EXTENT_MISMATCH,
                src.shard.global_extent,
                dst.shard.global_extent,
                "both sides must serve the same model (same global head/channel count), each "
                "registering the model's count, not one padded or replicated for its TP size",
            )
        ]
    sharded = not (src.shard.is_full and dst.shard.is_full)
    if sharded and (
        src.shard.groups != dst.shard.groups or src.shard.declared_groups != dst.shard.declared_groups
    ):
        return [_shard_groups_mismatch(src.path, src.shard, dst.shard, axis)]
    return _indivisible_groups(src.path, src.shard, dst.shard, tp_src, tp_dst, axis)


def _missing_shard_metadata(
    src: TensorView, dst: TensorView, tp_src: int, tp_dst: int, axis: str
) -> list[Mismatch]:
    """A side without shard metadata: fine unless the axis must be resliced."""
    same_item = src.item_nbytes == dst.item_nbytes
    if tp_src == tp_dst and same_item:
        return []
    reasons = [] if same_item else [f"item sizes differ ({src.item_nbytes} B vs {dst.item_nbytes} B)"]
    if tp_src != tp_dst:
        reasons.append(f"attention TP differs ({tp_src} vs {tp_dst})")
    return [
        Mismatch(
            f"{src.path}.shard",
            Reason.SHARD_METADATA_MISSING,
            diagnostics.describe_shard(src, axis),
            diagnostics.describe_shard(dst, axis),
            f"{' and '.join(reasons)}, so '{axis}' must be resliced, which needs "
            "per-tensor dim metadata on both sides: register the global extent and "
            "the local [start, end) of the sharded axis, or run both sides with equal "
            "attention TP",
        )
    ]


def _shard_groups_mismatch(path: str, src: ShardSpec, dst: ShardSpec, axis: str) -> Mismatch:
    """The sides disagree on the shard groups of a sharded axis (or one did not declare them)."""
    code = (
        Reason.SHARD_GROUPS_MISSING
        if src.declared_groups != dst.declared_groups
        else Reason.SHARD_GROUPS_MISMATCH
    )
    return Mismatch(
        f"{path}.{axis}.shard_groups",
        code,
        list(src.groups) if src.declared_groups else None,
        list(dst.groups) if dst.declared_groups else None,
        f"'{axis}' is a concatenation of independently sharded groups: both sides must "
        "register the same shard groups, or slicing would mix channels of different groups",
    )


def _indivisible_groups(
    path: str, src: ShardSpec, dst: ShardSpec, tp_src: int, tp_dst: int, axis: str
) -> list[Mismatch]:
    """One mismatch per shard group that a side's attention TP cannot split."""
    found = []
    for group in src.groups:
        # the same group on both sides (global extents and groups are equal here)
        splits = {
            side: spec.is_full or _splits(group, tp)
            for side, spec, tp in (("prefill", src, tp_src), ("decode", dst, tp_dst))
        }
        if all(splits.values()):
            continue
        values = {
            side: f"{group} over attn_tp {tp}" + ("" if splits[side] else " (does not split)")
            for side, tp in (("prefill", tp_src), ("decode", tp_dst))
        }
        found.append(
            Mismatch(
                f"{path}.{axis}",
                Reason.SHARD_NOT_DIVISIBLE,
                values["prefill"],
                values["decode"],
                f"choose attention TP sizes that divide {group} (or that {group} divides)",
            )
        )
    return found


def _splits(extent: int, tp_size: int) -> bool:
    try:
        canonical_range(extent, tp_size, 0)
    except GeometryError:
        return False
    return True
