"""Planning one (source rank, destination rank) transfer.

:func:`plan_pair` takes an accepted :class:`Reconciliation`, the two ranks and
the request's index lists per pool (pages for KV and SWA, slots for Mamba
state, rows for aux), checks the index lists (equal counts, inside both
pools: never truncated), turns every tensor pair and shard piece into a block
copy and lowers them all into one :class:`TransferPlan`.

Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.grids import Grid, GridPlan
from pd_transfer.layout.lowering import TransferPlan, Unit, UnitGroup, group_units, lower_groups
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.sharding import Piece
from pd_transfer.layout.views import AxisRole, Pool, TensorView

IndexPair = tuple[np.ndarray, np.ndarray]

_ITEM_WORD = {Pool.KV: "page", Pool.SWA: "page", Pool.MAMBA: "slot", Pool.AUX: "row"}


def plan_pair(reconciliation: Reconciliation, src: RankGeometry, dst: RankGeometry,
              requests: Mapping[Pool, IndexPair]) -> TransferPlan:
    """The plan for what ``src`` writes into ``dst`` for one request."""
    return PairPlanner(reconciliation, src, dst).plan(requests)


class PairPlanner:
    """:func:`plan_pair` with everything independent of the index lists done once.

    A sidecar builds one per accepted peer pair at verdict time; a request then
    costs a pattern per tensor structure and a broadcast add (a 1-page room of
    a 64-tensor model plans in tens of microseconds, not a millisecond).
    """

    def __init__(self, reconciliation: Reconciliation, src: RankGeometry, dst: RankGeometry) -> None:
        reconciliation.raise_if_rejected()
        self.src, self.dst = src, dst
        units: dict[Pool, list[Unit]] = {}
        for dst_view in dst.views:
            src_view = src.view(dst_view.key)
            if src_view is None:
                continue
            for piece in reconciliation.pieces(dst_view.key, dst).get(src.rank_id, ()):
                units.setdefault(dst_view.pool, []).append(block_unit(src_view, dst_view, piece))
        self._groups = {pool: group_units(pool_units) for pool, pool_units in units.items()}
        self._limits = {side: _index_limits(geometry)
                        for side, geometry in (("prefill", src), ("decode", dst))}

    def plan(self, requests: Mapping[Pool, IndexPair],
             layers: Collection[int] | None = None, *, grid_max_runs: int = 0) -> TransferPlan:
        """The plan for ``requests``; with ``layers``, only the tensors of those layer ids.

        Layer-wise streaming plans a chunk's KV one batch of ready layers at a
        time; the union over all layers is exactly the plan without ``layers``.
        A plan of at most ``grid_max_runs`` runs comes as a :class:`GridPlan`
        (not lowered; for a writer that copies grids, such as a 1-page room's).
        """
        indices = check_indices(requests, self.src, self.dst, self._limits)
        groups = [g for pool in indices for g in self._groups.get(pool, ())]
        if grid_max_runs and layers is None:
            small = GridPlan(self.src.rank_id, self.dst.rank_id,
                             tuple(Grid(group, *indices[group.pool]) for group in groups))
            if small.num_runs <= grid_max_runs:   # (cached: the writer reads it again)
                return small
        if layers is not None:
            wanted = np.fromiter(layers, np.int64)
            groups = [g for g in (group.only_layers(wanted) for group in groups) if g is not None]
        return lower_groups(self.src.rank_id, self.dst.rank_id, groups, indices)

    def unit_groups(self, pool: Pool) -> tuple[UnitGroup, ...]:
        """The block copies :meth:`plan` lowers for ``pool``, grouped by structure."""
        return tuple(self._groups.get(pool, ()))


def _index_limits(geometry: RankGeometry) -> dict[Pool, int]:
    limits: dict[Pool, int] = {}
    for view in geometry.views:
        limits[view.pool] = min(limits.get(view.pool, view.index_count), view.index_count)
    return limits


def check_indices(requests: Mapping[Pool, IndexPair], src: RankGeometry,
                  dst: RankGeometry, limits: dict | None = None) -> dict[Pool, IndexPair]:
    """Validate index lists per pool; raise :class:`PlanError` naming the pool."""
    checked: dict[Pool, IndexPair] = {}
    for pool, (src_raw, dst_raw) in requests.items():
        src_idx = np.asarray(src_raw, dtype=np.int64).reshape(-1)
        dst_idx = np.asarray(dst_raw, dtype=np.int64).reshape(-1)
        word = _ITEM_WORD.get(pool, "index")
        if len(src_idx) != len(dst_idx):
            raise PlanError(
                f"{pool.value}: prefill sends {len(src_idx)} {word}(s) but decode expects "
                f"{len(dst_idx)}; the request is refused rather than truncated",
                code=Reason.INDEX_COUNT_MISMATCH,
                hint=f"allocate as many destination {word}s as the source sends")
        limits = limits or {side: _index_limits(g) for side, g in (("prefill", src), ("decode", dst))}
        for geometry, idx, side in ((src, src_idx, "prefill"), (dst, dst_idx, "decode")):
            _check_range(pool, geometry, idx, side, word, limits[side].get(pool))
        checked[pool] = (src_idx, dst_idx)
    return checked


def _check_range(pool: Pool, geometry: RankGeometry, idx: np.ndarray, side: str, word: str,
                 limit: int | None) -> None:
    if limit is None or len(idx) == 0:
        return
    if len(idx) <= 64:  # a few pages: plain Python beats two numpy reductions
        values = idx.tolist()
        low, high = min(values), max(values)
    else:
        low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise PlanError(
            f"{pool.value}: {side} {word} index {bad} is outside {geometry.rank_id}'s pool "
            f"of {limit} {word}s", code=Reason.INDEX_OUT_OF_RANGE,
            hint=f"{word} indices must be in [0, {limit})")


def block_unit(src: TensorView, dst: TensorView, piece: Piece) -> Unit:
    """The block copy of ``piece`` of the shard axis, as a lowering unit."""
    src_base, dst_base = src.offset_nbytes, dst.offset_nbytes
    src_shard = src.axis_index(AxisRole.SHARD)
    if src_shard is not None:
        src_base += piece.src_start * src.strides_nbytes[src_shard]
        dst_base += piece.dst_start * dst.strides_nbytes[dst.axis_index(AxisRole.SHARD)]
    axes = []
    src_index = src.axis_index(AxisRole.INDEX)
    for i, axis in enumerate(src.axes):
        if i == src_index:
            continue
        j = dst.axis_named(axis.name)
        extent = piece.length if i == src_shard else dst.shape[j]
        axes.append((extent, src.strides_nbytes[i], dst.strides_nbytes[j]))
    index_strides = (src.strides_nbytes[src_index],
                     dst.strides_nbytes[dst.axis_index(AxisRole.INDEX)])
    return Unit(src.region, dst.region, src_base, dst_base, src.itemsize, tuple(axes),
                index_strides, src.pool, src.layer_id)
