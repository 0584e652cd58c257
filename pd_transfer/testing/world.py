"""A simulated prefill/decode world: every rank's regions as numpy buffers.

:meth:`World.build` allocates every region of every rank, fills it with
random bytes, invents a random logical tensor per tensor key registered on
both sides and writes each prefill view's shard of it through the view's
strides. :meth:`World.execute` runs a plan's byte runs;
:meth:`World.verify` says, byte for byte, whether the decode side now holds
what the requests owe it and nothing else changed.

This is the ground truth the planner is checked against, so it reads only the
registered layout description (views, geometry) and recomputes everything
else itself. It must never import ``pd_transfer.layout.planner``,
``reconcile``, ``lowering`` or ``sharding``, nor anything above the layout
layer.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.errors import GeometryError, PlanError, Reason
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.views import TensorView
from pd_transfer.testing import oracle, runs
from pd_transfer.testing.logical import LogicalTensor, axis_order, make_logical
from pd_transfer.testing.placement import fit_problem, overlap_problems, window
from pd_transfer.testing.shards import shard_problems

Buffers = dict[str, dict[str, np.ndarray]]  # rank_id -> region id -> flat uint8 buffer


class World:
    """Numpy buffers for every rank of both sides, plus the truth they derive from."""

    def __init__(
        self,
        prefill: dict[str, RankGeometry],
        decode: dict[str, RankGeometry],
        tensors: dict[tuple, LogicalTensor],
        buffers: dict[Role, Buffers],
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.tensors = tensors
        self._buffers = buffers
        self._snapshots = {role: _copy(b) for role, b in buffers.items()}
        self._written: dict[tuple[str, str], np.ndarray] = {}
        self._rewrites = oracle.Report()

    # -- construction -------------------------------------------------------
    @classmethod
    def build(cls, prefill: list[RankGeometry], decode: list[RankGeometry], seed: int) -> World:
        """Allocate, check and fill a world; raises :class:`GeometryError` on a bad registration."""
        rng = np.random.default_rng(seed)
        ranks = {
            Role.PREFILL: _index_ranks(prefill, Role.PREFILL),
            Role.DECODE: _index_ranks(decode, Role.DECODE),
        }
        for geometries in ranks.values():
            for geometry in geometries.values():
                _check_rank(geometry)
        buffers = {
            role: {rank_id: _allocate(g, rng) for rank_id, g in geometries.items()}
            for role, geometries in ranks.items()
        }
        tensors = _logical_tensors(ranks, rng)
        for rank_id, geometry in ranks[Role.PREFILL].items():
            for view in geometry.views:
                logical = tensors.get(view.key)
                if logical is not None:
                    order = axis_order(view, logical, same_index_count=True, rank_id=rank_id)
                    window(buffers[Role.PREFILL][rank_id][view.region], view, order)[...] = logical.slice_for(
                        view
                    )
        return cls(ranks[Role.PREFILL], ranks[Role.DECODE], tensors, buffers)

    @property
    def prefill_buffers(self) -> Buffers:
        return self._buffers[Role.PREFILL]

    @property
    def decode_buffers(self) -> Buffers:
        return self._buffers[Role.DECODE]

    # -- transfer -------------------------------------------------------------
    def execute(self, plan) -> None:
        """Copy a plan's byte runs from its prefill rank to its decode rank.

        Every run is bounds-checked first; a plan with any bad run raises
        :class:`PlanError` and copies nothing.
        """
        where = f"plan {plan.src_rank} -> {plan.dst_rank}"
        if plan.src_rank not in self.prefill:
            raise PlanError(f"{where}: unknown prefill rank {plan.src_rank!r}", code=Reason.UNKNOWN_REGION)
        if plan.dst_rank not in self.decode:
            raise PlanError(f"{where}: unknown decode rank {plan.dst_rank!r}", code=Reason.UNKNOWN_REGION)
        src_regions = self.prefill_buffers[plan.src_rank]
        dst_regions = self.decode_buffers[plan.dst_rank]
        batches = [
            runs.load_runs(b, f"{where} batch {i}", src_regions, dst_regions)
            for i, b in enumerate(plan.batches)
        ]
        self._record_rewrites(where, plan.dst_rank, batches)
        for batch in batches:
            runs.copy_runs(src_regions[batch.src_region], dst_regions[batch.dst_region], batch)

    def _record_rewrites(self, where: str, dst_rank: str, batches: list[runs.BatchRuns]) -> None:
        for region_id in sorted({b.dst_region for b in batches}):
            mine = [b for b in batches if b.dst_region == region_id]
            offset = np.concatenate([b.dst_offset for b in mine])
            nbytes = np.concatenate([b.nbytes for b in mine])
            clashes, first = runs.self_overlap(offset, nbytes)
            if clashes:
                self._rewrites.add(
                    f"{where}: {clashes} run(s) write destination bytes another run "
                    f"of the same plan writes, in region {region_id!r}, first at "
                    f"byte {first}"
                )
            written = self._written.setdefault(
                (dst_rank, region_id), np.zeros(self.decode_buffers[dst_rank][region_id].size, bool)
            )
            again, first = runs.mark_written(written, offset, nbytes)
            if again:
                self._rewrites.add(
                    f"{where}: {again} byte(s) of region {region_id!r} were already "
                    f"written by an earlier plan, first at byte {first} "
                    f"(one writer must be elected)"
                )

    # -- verdict ----------------------------------------------------------------
    def verify(self, requests: dict | list[dict]) -> list[str]:
        """Discrepancy lines (at most ~20 plus a count); an empty list means byte-exact.

        ``requests`` maps :class:`Pool` to ``(src_indices, dst_indices)``: page
        indices for KV/SWA, slot indices for MAMBA, row indices for AUX. A
        KV/SWA request may be a :class:`~pd_transfer.layout.spans.TokenSpan`;
        where the decode page size differs from prefill's, a plain pair is
        the span starting both lists at token 0. A list of such maps is
        several rooms moved into one world (their destinations disjoint).
        Bytes written more than once by :meth:`execute` count as discrepancies
        too, so build a fresh world per scenario.
        """
        rooms = requests if isinstance(requests, list) else [requests]
        wanted = [oracle.normalise_requests(room) for room in rooms]
        report = oracle.Report()
        report.total, report.shown = self._rewrites.total, list(self._rewrites.shown)
        for rank_id, geometry in self.decode.items():
            self._verify_decode_rank(report, rank_id, geometry, wanted)
        for rank_id, geometry in self.prefill.items():
            for region_id, buf in self.prefill_buffers[rank_id].items():
                oracle.check_untouched(
                    report,
                    rank_id,
                    region_id,
                    buf,
                    self._snapshots[Role.PREFILL][rank_id][region_id],
                    None,
                    _views_in(geometry, region_id),
                )
        return report.lines()

    def _verify_decode_rank(
        self, report: oracle.Report, rank_id: str, geometry: RankGeometry, rooms: list[dict]
    ) -> None:
        buffers = self.decode_buffers[rank_id]
        covered = {region_id: np.zeros(buf.size, bool) for region_id, buf in buffers.items()}
        for view, wanted in ((v, w) for w in rooms for v in geometry.views):
            if view.pool not in wanted:
                continue
            logical = self.tensors.get(view.key)
            if logical is None:
                report.add(
                    f"{rank_id} {view.path}: requested, but no prefill rank registers "
                    f"this tensor, so nothing can fill it"
                )
                continue
            owed = wanted[view.pool]
            order = axis_order(view, logical, same_index_count=False, rank_id=rank_id)
            if oracle.is_token_paged(view, logical, owed):
                oracle.compare_tokens(report, rank_id, view, order, logical, buffers[view.region], owed)
                oracle.mark_tokens(covered[view.region], view, order, logical, owed)
                continue
            oracle.compare_view(
                report, rank_id, view, order, logical, buffers[view.region], owed.src, owed.dst
            )
            oracle.mark_covered(covered[view.region], view, order, owed.dst)
        for region_id, buf in buffers.items():
            oracle.check_untouched(
                report,
                rank_id,
                region_id,
                buf,
                self._snapshots[Role.DECODE][rank_id][region_id],
                covered[region_id],
                _views_in(geometry, region_id),
            )

    def assert_exact(self, requests: dict) -> None:
        """Raise AssertionError listing the discrepancies unless :meth:`verify` finds none."""
        lines = self.verify(requests)
        if lines:
            raise AssertionError("transfer is not byte-exact:\n  " + "\n  ".join(lines))


# -- build steps ---------------------------------------------------------------
def _index_ranks(geometries: list[RankGeometry], role: Role) -> dict[str, RankGeometry]:
    out: dict[str, RankGeometry] = {}
    for geometry in geometries:
        if geometry.role is not role:
            raise GeometryError(f"{geometry.rank_id} was passed as a {role.value} rank", code=Reason.BAD_VIEW)
        if geometry.rank_id in out:
            raise GeometryError(f"rank {geometry.rank_id} is given twice", code=Reason.BAD_VIEW)
        out[geometry.rank_id] = geometry
    return out


def _check_rank(geometry: RankGeometry) -> None:
    """Refuse a registration the oracle cannot lay out safely or that shards wrongly."""
    sizes = {r.id: r.nbytes for r in geometry.regions}
    problems = [] if len(sizes) == len(geometry.regions) else ["region ids repeat"]
    keys = [v.key for v in geometry.views]
    if len(set(keys)) != len(keys):
        problems.append("a tensor key is registered twice")
    sharding = [p for v in geometry.views for p in shard_problems(v, geometry.tp_size, geometry.tp_rank)]
    problems += [p for p in (fit_problem(v, sizes.get(v.region)) for v in geometry.views) if p]
    if not problems:  # overlap is only safe to probe once every view fits
        for region_id, nbytes in sizes.items():
            problems += overlap_problems(_views_in(geometry, region_id), nbytes)
    if problems or sharding:
        lines = [f"the oracle refuses {geometry.rank_id} (tp {geometry.tp_rank}/{geometry.tp_size}):"]
        lines += [f"  - {p}" for p in sharding + problems]
        raise GeometryError(
            "\n".join(lines), code=Reason.SHARD_RANGE_INVALID if sharding else Reason.BAD_VIEW
        )


def _allocate(geometry: RankGeometry, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {r.id: np.frombuffer(rng.bytes(r.nbytes), dtype=np.uint8).copy() for r in geometry.regions}


def _logical_tensors(
    ranks: dict[Role, dict[str, RankGeometry]], rng: np.random.Generator
) -> dict[tuple, LogicalTensor]:
    """One logical tensor per key on both sides, checked against every view of it."""
    reference: dict[tuple, TensorView] = {}
    for geometry in ranks[Role.PREFILL].values():
        for view in geometry.views:
            reference.setdefault(view.key, view)
    decode_keys = {v.key for g in ranks[Role.DECODE].values() for v in g.views}
    tensors = {key: make_logical(view, rng) for key, view in reference.items() if key in decode_keys}
    for role, geometries in ranks.items():
        for rank_id, geometry in geometries.items():
            for view in geometry.views:
                if view.key in tensors:
                    axis_order(
                        view, tensors[view.key], same_index_count=role is Role.PREFILL, rank_id=rank_id
                    )
    return tensors


def _views_in(geometry: RankGeometry, region_id: str) -> list[TensorView]:
    return [v for v in geometry.views if v.region == region_id]


def _copy(buffers: Buffers) -> Buffers:
    return {
        rank_id: {region_id: buf.copy() for region_id, buf in regions.items()}
        for rank_id, regions in buffers.items()
    }
