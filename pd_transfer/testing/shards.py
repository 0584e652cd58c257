"""Tensor-parallel shard arithmetic, recomputed independently for the oracle.

The oracle must not trust the code it checks, so the range a rank should hold
is derived here from first principles (:func:`expected_range`) instead of from
``pd_transfer.layout.views.canonical_range`` or the planner. A registration
whose shard ranges disagree is refused when the world is built, so a builder
bug cannot hide behind a planner that shares it.

Imports numpy and the layout *description* (views) only; never the planner,
reconciliation, lowering or sharding modules.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.errors import GeometryError, Reason
from pd_transfer.layout.views import AxisRole, ShardSpec, TensorView


def expected_range(group_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` that ``tp_rank`` of ``tp_size`` holds of one shard group.

    A group at least as large as the TP degree splits evenly
    (8 heads over tp=4: rank 1 holds [2, 4)). A smaller group is replicated:
    2 KV heads over tp=8 puts head 0 on ranks 0-3 and head 1 on ranks 4-7,
    i.e. rank r holds element r // (tp_size / group_size).
    """
    if group_size <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise GeometryError(
            f"no shard range for group {group_size}, tp_size {tp_size}, tp_rank {tp_rank}",
            code=Reason.SHARD_RANGE_INVALID,
        )
    if group_size >= tp_size:
        if group_size % tp_size != 0:
            raise GeometryError(
                f"group of {group_size} does not split over tp_size {tp_size}",
                code=Reason.SHARD_NOT_DIVISIBLE,
            )
        width = group_size // tp_size
        return tp_rank * width, tp_rank * width + width
    if tp_size % group_size != 0:
        raise GeometryError(
            f"group of {group_size} cannot be replicated evenly over tp_size {tp_size}",
            code=Reason.SHARD_NOT_DIVISIBLE,
        )
    ranks_per_element = tp_size // group_size
    element = tp_rank // ranks_per_element
    return element, element + 1


def view_shard(view: TensorView) -> ShardSpec:
    """The shard spec of a view whose shard axis the oracle reads; GeometryError without one."""
    if view.shard is None:
        raise GeometryError(
            f"{view.path}: a shard axis without its shard spec", code=Reason.SHARD_METADATA_MISSING
        )
    return view.shard


def shard_positions(shard: ShardSpec) -> np.ndarray:
    """Global positions of each local element along the shard axis.

    The local axis is the concatenation of the local ranges in group order:
    groups (4, 4, 8) with ranges ((2,4), (2,4), (4,8)) give
    [2, 3, 6, 7, 12, 13, 14, 15] (group bases 0, 4, 8).
    """
    bases = np.concatenate(([0], np.cumsum(shard.groups[:-1], dtype=np.int64)))
    parts = [
        np.arange(base + start, base + end, dtype=np.int64)
        for base, (start, end) in zip(bases, shard.ranges, strict=True)
    ]
    return np.concatenate(parts)


def shard_problems(view: TensorView, tp_size: int, tp_rank: int) -> list[str]:
    """Why ``view`` does not hold the shard ``tp_rank`` of ``tp_size`` should; [] if it does.

    A group holding its full extent counts as replicated (an MLA latent or a
    tensor the engine keeps whole on every rank) and is accepted.
    """
    if view.axis_index(AxisRole.SHARD) is None:
        return []
    if view.shard is None:
        return [f"{view.path}: has a shard axis but no shard ranges; the oracle will not guess them"]
    if len(view.shard.groups) != len(view.shard.ranges):
        return [f"{view.path}: {len(view.shard.groups)} shard groups but {len(view.shard.ranges)} ranges"]
    problems = []
    for group, got in zip(view.shard.groups, view.shard.ranges, strict=True):
        if tuple(got) == (0, group):
            continue
        try:
            want = expected_range(group, tp_size, tp_rank)
        except GeometryError as exc:
            problems.append(f"{view.path}: {exc.message}")
            continue
        if tuple(got) != want:
            problems.append(
                f"{view.path}: holds [{got[0]},{got[1]}) of group {group} but "
                f"tp_rank {tp_rank}/{tp_size} should hold [{want[0]},{want[1]})"
            )
    return problems
