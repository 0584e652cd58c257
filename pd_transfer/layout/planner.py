"""Planning one (source rank, destination rank) transfer.

:func:`plan_pair` takes an accepted :class:`Reconciliation`, the two ranks and
the request's index lists per pool (pages for KV and SWA, slots for Mamba
state, rows for aux), checks the index lists (equal counts, inside both
pools: never truncated), turns every tensor pair and shard piece into a block
copy and lowers them all into one :class:`TransferPlan`.

Where a token-paged pool (KV, SWA) has different page sizes on the two sides,
its request is a :class:`~pd_transfer.layout.spans.TokenSpan` (a plain pair
is the span that starts both lists at token 0): the owed tokens are mapped in
granules (:mod:`.token_map`), each a block copy of a few tokens, joined by
the lowering where they continue each other on both sides.

Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import cast

import numpy as np

from pd_transfer.errors import PlanError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.grids import Grid, GridPlan
from pd_transfer.layout.lowering import TransferPlan, Unit, UnitGroup, group_units, lower_groups
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.sharding import Piece
from pd_transfer.layout.spans import TokenSpan, request_lengths_agree
from pd_transfer.layout.token_map import granule_tokens, granules
from pd_transfer.layout.views import AxisRole, Pool, TensorView

IndexPair = tuple[np.ndarray, np.ndarray]
Request = IndexPair | TokenSpan

_ITEM_WORD = {Pool.KV: "page", Pool.SWA: "page", Pool.MAMBA: "slot", Pool.AUX: "row"}


def plan_pair(
    reconciliation: Reconciliation, src: RankGeometry, dst: RankGeometry, requests: Mapping[Pool, Request]
) -> TransferPlan:
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
        # per instance: a pipeline stage without a pool's layers still gets its requests
        self._page_sizes = converted_page_sizes(
            reconciliation.prefill or (src,), reconciliation.decode or (dst,)
        )
        units: dict[Pool, list[Unit]] = {}
        for dst_view in dst.views:
            src_view = src.view(dst_view.key)
            if src_view is None:
                continue
            for piece in reconciliation.pieces(dst_view.key, dst).get(src.rank_id, ()):
                sizes = self._page_sizes.get(dst_view.pool)
                granule = None if sizes is None else granule_tokens(*sizes)
                units.setdefault(dst_view.pool, []).append(block_unit(src_view, dst_view, piece, granule))
        self._groups = {pool: group_units(pool_units) for pool, pool_units in units.items()}
        self._limits = {
            side: _index_limits(geometry) for side, geometry in (("prefill", src), ("decode", dst))
        }

    def page_sizes(self, pool: Pool) -> tuple[int, int] | None:
        """``(prefill, decode)`` tokens per page where ``pool``'s page sizes differ, else None."""
        return self._page_sizes.get(pool)

    @property
    def pools(self) -> frozenset[Pool]:
        """The pools this pair moves bytes of: a pipeline stage that holds no layer of a
        pool (state layers all on another stage) neither sends nor receives its indices."""
        return frozenset(self._groups)

    def plan(
        self,
        requests: Mapping[Pool, Request],
        layers: Collection[int] | None = None,
        *,
        grid_max_runs: int = 0,
    ) -> TransferPlan:
        """The plan for ``requests``; with ``layers``, only the tensors of those layer ids.

        Layer-wise streaming plans a chunk's KV one batch of ready layers at a
        time; the union over all layers is exactly the plan without ``layers``.
        A plan of at most ``grid_max_runs`` runs comes as a :class:`GridPlan`
        (not lowered; for a writer that copies grids, such as a 1-page room's).
        """
        indices = check_indices(requests, self.src, self.dst, self._limits, self._page_sizes)
        groups = [g for pool in indices for g in self._groups.get(pool, ())]
        if grid_max_runs and layers is None and not any(len(i) > 2 for i in indices.values()):
            small = GridPlan(
                self.src.rank_id,
                self.dst.rank_id,
                tuple(Grid(group, *indices[cast(Pool, group.pool)]) for group in groups),  # by pool
            )
            if small.num_runs <= grid_max_runs:  # (cached: the writer reads it again)
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


def converted_page_sizes(
    prefill: Sequence[RankGeometry], decode: Sequence[RankGeometry]
) -> dict[Pool, tuple[int, int]]:
    """``{pool: (prefill, decode) page size}`` of the token-paged pools whose page sizes differ.

    A pool's page size on one side is its views' token extent over the
    instance's ranks (one value per pool and side: an instance that mixes
    them is refused here).
    """
    sizes: dict[Pool, tuple[int, int]] = {}
    for pool in (Pool.KV, Pool.SWA):
        per_side: list[int | None] = []
        for ranks in (prefill, decode):
            extents = {
                extent
                for g in ranks
                for v in g.views
                if v.pool is pool and (extent := v.extent(AxisRole.TOKEN)) is not None
            }
            if len(extents) > 1:
                raise PlanError(
                    f"{pool.value}: {ranks[0].role.value} registers pages of "
                    f"{sorted(extents)} tokens in one pool",
                    code=Reason.PAGE_SIZE_MISMATCH,
                    hint="every tensor of one pool has the same tokens per page",
                )
            per_side.append(extents.pop() if extents else None)
        prefill_size, decode_size = per_side
        if prefill_size is not None and decode_size is not None and prefill_size != decode_size:
            sizes[pool] = (prefill_size, decode_size)
    return sizes


def check_indices(
    requests: Mapping[Pool, Request],
    src: RankGeometry,
    dst: RankGeometry,
    limits: dict | None = None,
    page_sizes: Mapping[Pool, tuple[int, int]] | None = None,
) -> dict[Pool, tuple]:
    """Validate index lists per pool; raise :class:`PlanError` naming the pool.

    A pool in ``page_sizes`` (different page sizes on the two sides) comes
    back as granules ``(src_page, dst_page, src_sub, dst_sub)``.
    """
    checked: dict[Pool, tuple] = {}
    limits = limits or {side: _index_limits(g) for side, g in (("prefill", src), ("decode", dst))}
    page_sizes = {} if page_sizes is None else page_sizes
    for pool, request in requests.items():
        word = _ITEM_WORD.get(pool, "index")
        if pool in page_sizes:
            checked[pool] = _check_span(pool, request, src, dst, limits, page_sizes[pool])
            continue
        if isinstance(request, TokenSpan):
            if request.src_first_token != request.dst_first_token:
                raise PlanError(
                    f"{pool.value}: page lists start at request tokens "
                    f"{request.src_first_token} (prefill) and "
                    f"{request.dst_first_token} (decode) but both sides' pages "
                    f"are the same size",
                    code=Reason.INDEX_COUNT_MISMATCH,
                    hint="with equal page sizes both page lists start at one token",
                )
            request = (request.src_pages, request.dst_pages)
        src_raw, dst_raw = request
        src_idx = np.asarray(src_raw, dtype=np.int64).reshape(-1)
        dst_idx = np.asarray(dst_raw, dtype=np.int64).reshape(-1)
        if len(src_idx) != len(dst_idx):
            raise PlanError(
                f"{pool.value}: prefill sends {len(src_idx)} {word}(s) but decode expects "
                f"{len(dst_idx)}; the request is refused rather than truncated",
                code=Reason.INDEX_COUNT_MISMATCH,
                hint=f"allocate as many destination {word}s as the source sends",
            )
        for geometry, idx, side in ((src, src_idx, "prefill"), (dst, dst_idx, "decode")):
            _check_range(pool, geometry, idx, side, word, limits[side].get(pool))
        checked[pool] = (src_idx, dst_idx)
    return checked


def _check_span(
    pool: Pool, request: Request, src: RankGeometry, dst: RankGeometry, limits: dict, sizes: tuple[int, int]
) -> tuple:
    """Granules of a request for a pool whose page sizes differ."""
    if isinstance(request, TokenSpan):
        span = TokenSpan(
            np.asarray(request.src_pages, dtype=np.int64).reshape(-1),
            np.asarray(request.dst_pages, dtype=np.int64).reshape(-1),
            int(request.src_first_token),
            int(request.dst_first_token),
        )
    else:
        src_raw, dst_raw = request
        span = TokenSpan(
            np.asarray(src_raw, dtype=np.int64).reshape(-1), np.asarray(dst_raw, dtype=np.int64).reshape(-1)
        )
        if not request_lengths_agree(len(span.src_pages), len(span.dst_pages), *sizes):
            raise PlanError(
                f"{pool.value}: prefill sends {len(span.src_pages)} page(s) of {sizes[0]} tokens "
                f"but decode expects {len(span.dst_pages)} page(s) of {sizes[1]} tokens; no "
                f"token count fills both, so the request is refused rather than truncated",
                code=Reason.INDEX_COUNT_MISMATCH,
                hint=f"allocate ceil(tokens / {sizes[1]}) destination pages for a request of "
                f"ceil(tokens / {sizes[0]}) source pages",
            )
    for geometry, idx, side in ((src, span.src_pages, "prefill"), (dst, span.dst_pages, "decode")):
        _check_range(pool, geometry, idx, side, "page", limits[side].get(pool))
    return granules(span, *sizes, pool.value)


def _check_range(
    pool: Pool, geometry: RankGeometry, idx: np.ndarray, side: str, word: str, limit: int | None
) -> None:
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
            f"of {limit} {word}s",
            code=Reason.INDEX_OUT_OF_RANGE,
            hint=f"{word} indices must be in [0, {limit})",
        )


def block_unit(src: TensorView, dst: TensorView, piece: Piece, granule: int | None = None) -> Unit:
    """The block copy of ``piece`` of the shard axis, as a lowering unit.

    ``granule`` (page sizes differ) makes it a copy of that many tokens
    addressed by ``(page, sub)`` (see :mod:`.token_map`).
    """
    src_base, dst_base = src.offset_nbytes, dst.offset_nbytes
    src_shard = src.axis_index(AxisRole.SHARD)
    if src_shard is not None:
        src_base += piece.src_start * src.strides_nbytes[src_shard]
        dst_base += piece.dst_start * dst.strides_nbytes[dst.axis_of(AxisRole.SHARD)]
    axes = []
    src_index = src.axis_of(AxisRole.INDEX)
    for i, axis in enumerate(src.axes):
        if i == src_index:
            continue
        j = dst.axis_named(axis.name)
        extent = piece.length if i == src_shard else dst.shape[j]
        if granule is not None and axis.role is AxisRole.TOKEN:
            extent = granule
        axes.append((extent, src.strides_nbytes[i], dst.strides_nbytes[j]))
    index_strides = (src.strides_nbytes[src_index], dst.strides_nbytes[dst.axis_of(AxisRole.INDEX)])
    sub_strides = None
    if granule is not None:
        src_token, dst_token = src.axis_of(AxisRole.TOKEN), dst.axis_of(AxisRole.TOKEN)
        sub_strides = (granule * src.strides_nbytes[src_token], granule * dst.strides_nbytes[dst_token])
    return Unit(
        src.region,
        dst.region,
        src_base,
        dst_base,
        src.itemsize,
        tuple(axes),
        index_strides,
        src.pool,
        src.layer_id,
        sub_strides,
    )
