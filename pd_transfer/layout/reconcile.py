"""Reconciliation: can these prefill ranks feed these decode ranks, and how?

:func:`reconcile` pairs tensors by key ``(pool, layer_id, name)``, never by
position, compares every pair, and returns a :class:`Reconciliation`: one
:class:`TensorVerdict` per pair (``direct``, ``sliced``, ``replicated`` or
``converted``) or, when anything cannot be reconciled, *every* mismatch with
both sides' values, a stable reason code and a hint. Nothing degrades
silently: a tensor is never copied as a whole item when its slicing metadata is
missing and the sizes differ, index lists are never truncated.

Pure; no I/O. Uses :mod:`sharding` for the rank mapping.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field

from pd_transfer.errors import Mismatch, Reason, ReconcileError
from pd_transfer.layout import diagnostics
from pd_transfer.layout.geometry import RankGeometry, RegistrationProblem, registration_problems
from pd_transfer.layout.page_sizes import converted_pages, page_size_mismatches
from pd_transfer.layout.sharding import Holder, Piece, assign_pieces
from pd_transfer.layout.tensor_compare import compare_tensors
from pd_transfer.layout.views import AxisRole, Layout, Pool, TensorView


class Mode(enum.Enum):
    DIRECT = "direct"  # identical geometry: copy items as they are
    SLICED = "sliced"  # different TP on a sharded axis: copy parts of it
    REPLICATED = "replicated"  # every source rank holds it: one elected writer
    CONVERTED = "converted"  # same data, different strides or layout


@dataclass(frozen=True)
class TensorVerdict:
    key: tuple
    path: str
    mode: Mode
    layout_changed: bool
    prefill_layout: Layout
    decode_layout: Layout
    page_sizes: tuple[int, int] | None = None  # (prefill, decode) tokens per page, when they differ


@dataclass(frozen=True)
class Reconciliation:
    prefill: tuple[RankGeometry, ...]
    decode: tuple[RankGeometry, ...]
    verdicts: tuple[TensorVerdict, ...]
    mismatches: tuple[Mismatch, ...]
    _holders: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def headline(self) -> str:
        """Which sides, by attention TP; by model too where the two name different models
        (``cannot reconcile prefill (llama-3.1-8b, attn_tp=1) with decode (nemotron-h-4b, ...)``)."""
        models = {g.model for g in self.prefill[:1] + self.decode[:1]}
        named = len(models) > 1 and "" not in models

        def side(role: str, ranks: tuple[RankGeometry, ...]) -> str:
            model = f"{ranks[0].model}, " if named and ranks else ""
            return f"{role} ({model}attn_tp={_tp(ranks)})"

        return f"cannot reconcile {side('prefill', self.prefill)} with {side('decode', self.decode)}"

    def error(self) -> ReconcileError:
        return ReconcileError(self.headline, diagnostics.collapse(list(self.mismatches)))

    def raise_if_rejected(self) -> None:
        if self.mismatches:
            raise self.error()

    def pieces(self, key: tuple, dst: RankGeometry) -> dict[str, tuple[Piece, ...]]:
        """Per source rank id, what of ``key`` it writes into ``dst``."""
        view = dst.view(key)
        holders = self._holders.get(key, ())
        if view is None or not holders:
            return {}
        pieces, _ = assign_pieces(
            holders,
            view.shard,
            dst.tp_rank,
            _local_extent(view),
            src_tp_size=_tp(self.prefill),
            dst_tp_size=dst.tp_size,
        )
        return pieces

    def sources_for(self, dst: RankGeometry) -> list[str]:
        """Prefill rank ids ``dst`` needs (each writes some piece it needs)."""
        needed: set[str] = set()
        for view in dst.views:
            needed.update(self.pieces(view.key, dst))
        return [g.rank_id for g in self.prefill if g.rank_id in needed]

    def modes_by_pool(self) -> dict[Pool, dict[Mode, int]]:
        summary: dict[Pool, dict[Mode, int]] = defaultdict(lambda: defaultdict(int))
        for verdict in self.verdicts:
            summary[verdict.key[0]][verdict.mode] += 1
        return {pool: dict(modes) for pool, modes in summary.items()}


def reconcile(
    prefill: list[RankGeometry] | RankGeometry,
    decode: list[RankGeometry] | RankGeometry,
    *,
    require_all_prefill_layers: bool = True,
) -> Reconciliation:
    """Reconcile prefill ranks with decode ranks; see the module docstring.

    ``require_all_prefill_layers`` False skips the check that every prefill
    tensor has a decode counterpart: a single decode rank of a pipelined
    decode instance registers only its own stage.
    """
    prefill_ranks = (prefill,) if isinstance(prefill, RankGeometry) else tuple(prefill)
    decode_ranks = (decode,) if isinstance(decode, RankGeometry) else tuple(decode)
    mismatches = _geometry_mismatches(prefill_ranks, decode_ranks)
    holders = _holders_by_key(prefill_ranks)
    decode_views = _views_by_key(decode_ranks)
    verdicts: list[TensorVerdict] = []
    for key, views in decode_views.items():
        if key not in holders:
            mismatches.append(_missing(views[0], Reason.LAYER_MISSING, decode_side=True))
            continue
        src = _view_of(prefill_ranks, key, holders[key][0])
        pair_mismatches = compare_tensors(src, views[0], _tp(prefill_ranks), _tp(decode_ranks))
        pages = page_size_mismatches(src, views[0], prefill_ranks[0].page_size, decode_ranks[0].page_size)
        if pages:  # opaque pages of other sizes differ in bytes too: one cause, one line
            pair_mismatches = [
                m for m in pair_mismatches if m.code is not Reason.INNER_SHAPE_MISMATCH
            ] + pages
        if not pair_mismatches:
            pair_mismatches = _coverage(holders[key], views, decode_ranks, prefill_ranks)
        mismatches += pair_mismatches
        if not pair_mismatches:
            verdicts.append(_verdict(src, views[0], _tp(prefill_ranks), _tp(decode_ranks)))
    if require_all_prefill_layers:
        for key, key_holders in holders.items():
            if key not in decode_views:
                mismatches.append(
                    _missing(
                        _view_of(prefill_ranks, key, key_holders[0]), Reason.LAYER_MISSING, decode_side=False
                    )
                )
    return Reconciliation(prefill_ranks, decode_ranks, tuple(verdicts), tuple(mismatches), holders)


# -- helpers ------------------------------------------------------------------


def _tp(ranks: tuple[RankGeometry, ...]) -> int:
    return ranks[0].tp_size if ranks else 0


def _local_extent(view: TensorView) -> int:
    extent = view.extent(AxisRole.SHARD)
    return 1 if extent is None else extent


def _geometry_mismatches(prefill, decode) -> list[Mismatch]:
    found = []
    for side, ranks in (("prefill", prefill), ("decode", decode)):
        sizes = {g.tp_size for g in ranks}
        if len(sizes) > 1:
            found.append(
                Mismatch(
                    f"{side}.attn_tp_size",
                    Reason.SHARD_RANGE_INVALID,
                    sorted(sizes) if side == "prefill" else "-",
                    sorted(sizes) if side == "decode" else "-",
                    "every rank of one instance must report the same attn_tp_size",
                )
            )
        # one line per problem, the ranks that share it folded: a view that does not
        # split over attn_tp 4 is one fact on all four ranks, not four
        ranks_by_problem: dict[RegistrationProblem, list[RankGeometry]] = defaultdict(list)
        for geometry in ranks:
            for problem in registration_problems(geometry):
                ranks_by_problem[problem].append(geometry)
        for problem, holders in ranks_by_problem.items():
            text = f"{problem.detail} ({diagnostics.describe_ranks(holders)})"
            found.append(
                Mismatch(
                    problem.subject or f"{side}.registration",
                    problem.code,
                    text if side == "prefill" else "-",
                    text if side == "decode" else "-",
                    "fix the worker's registration",
                )
            )
    return found


def _holders_by_key(prefill) -> dict[tuple, tuple[Holder, ...]]:
    holders: dict[tuple, list[Holder]] = defaultdict(list)
    for geometry in prefill:
        for view in geometry.views:
            holders[view.key].append(Holder(geometry.rank_id, geometry.tp_rank, view.shard))
    return {k: tuple(v) for k, v in holders.items()}


def _views_by_key(ranks) -> dict[tuple, list[TensorView]]:
    views: dict[tuple, list[TensorView]] = defaultdict(list)
    for geometry in ranks:
        for view in geometry.views:
            views[view.key].append(view)
    return dict(views)


def _view_of(ranks, key: tuple, holder: Holder) -> TensorView:
    for geometry in ranks:
        if geometry.rank_id == holder.rank_id:
            return geometry.view(key)
    raise KeyError(holder.rank_id)


def _missing(view: TensorView, code: Reason, *, decode_side: bool) -> Mismatch:
    hint = (
        "pair instances of the same model; with pipeline parallelism every layer id "
        "must be registered by exactly one stage on each side"
    )
    present = f"registered ({view.layout.value})"
    if decode_side:
        return Mismatch(view.path, code, None, present, hint)
    return Mismatch(view.path, code, present, None, hint)


def _coverage(holders, dst_views, decode, prefill) -> list[Mismatch]:
    found = []
    for geometry in decode:
        view = geometry.view(dst_views[0].key)
        if view is None:
            continue
        _, uncovered = assign_pieces(
            holders,
            view.shard,
            geometry.tp_rank,
            _local_extent(view),
            src_tp_size=_tp(prefill),
            dst_tp_size=geometry.tp_size,
        )
        for gap in uncovered:
            found.append(
                Mismatch(
                    f"{view.path}.shard",
                    Reason.SHARD_UNCOVERED,
                    f"ranks {[h.rank_id for h in holders]} hold it",
                    f"{geometry.rank_id} needs group {gap.group} [{gap.start},{gap.end})",
                    "every prefill rank must be registered before decode can be planned",
                )
            )
    return found


def _verdict(src: TensorView, dst: TensorView, tp_src: int, tp_dst: int) -> TensorVerdict:
    if src.shard is not None and dst.shard is not None and src.shard.local_extent != dst.shard.local_extent:
        mode = Mode.SLICED
    elif tp_src != tp_dst:
        mode = Mode.REPLICATED
    else:
        mode = Mode.DIRECT
    layout_changed = src.layout is not dst.layout or _memory_order(src, dst) != _memory_order(dst, src)
    page_sizes = converted_pages(src, dst)
    if mode is Mode.DIRECT and (layout_changed or page_sizes):
        mode = Mode.CONVERTED
    return TensorVerdict(src.key, src.path, mode, layout_changed, src.layout, dst.layout, page_sizes)


def _memory_order(view: TensorView, other: TensorView) -> list[str]:
    """Axis names from outermost to innermost in memory, skipping axes of one
    element on either side (their stride means nothing)."""
    sized = [
        (s, a.name)
        for a, n, s in zip(view.axes, view.shape, view.strides_nbytes)
        if n > 1 and other.shape[other.axis_named(a.name)] > 1
    ]
    return [name for _, name in sorted(sized, key=lambda item: -item[0])]
