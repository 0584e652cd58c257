"""Grid plans (a small room, not lowered) move exactly the oracle's bytes, and refuse to
write outside a region or through a stale address."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.grids import GridPlan
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.testing import World
from pd_transfer.transport.copy import native_loop as native_copy
from pd_transfer.transport.copy.copy_engine import CopyEngine

CASES = {
    "direct tp2->2": dict(kind="llama", prefill_tp=2, decode_tp=2),
    "sliced tp2->4 (strided pieces)": dict(kind="llama", prefill_tp=2, decode_tp=4),
    "sliced tp4->2": dict(kind="llama", prefill_tp=4, decode_tp=2),
    "hnd -> page_first tp2->4": dict(
        kind="llama", prefill_tp=2, decode_tp=4, src_layout=Layout.HND, dst_layout=Layout.PAGE_FIRST
    ),
    "gdn state tp2->4": dict(kind="gdn", prefill_tp=2, decode_tp=4),
}
needs_native = pytest.mark.skipif(
    not native_copy.AVAILABLE, reason=f"native copy loop: {native_copy.UNAVAILABLE_WHY}"
)


def _grid_world(
    instance, kind, prefill_tp, decode_tp, src_layout=Layout.NHD, dst_layout=Layout.NHD, num_pages=8
):
    """A world and, per rank pair, the grid plan of a 2-page room (plus state and aux)."""
    prefill = instance(kind, Role.PREFILL, prefill_tp, src_layout, num_pages)
    decode = instance(kind, Role.DECODE, decode_tp, dst_layout, num_pages)
    recon = reconcile(prefill, decode)
    requests = {}
    for pool, (src, dst) in {Pool.KV: ([5, 1], [2, 7]), Pool.MAMBA: ([2], [0]), Pool.AUX: ([1], [0])}.items():
        if any(v.pool is pool for g in decode for v in g.views):
            requests[pool] = (np.array(src), np.array(dst))
    by_id = {g.rank_id: g for g in prefill}
    plans = [
        PairPlanner(recon, by_id[src_id], dst).plan(requests, grid_max_runs=1 << 20)
        for dst in decode
        for src_id in recon.sources_for(dst)
    ]
    return World.build(prefill, decode, 3), plans, requests


@needs_native
@pytest.mark.parametrize("case", sorted(CASES))
def test_grid_plans_move_exactly_the_oracles_bytes(ranks, case):
    world, plans, requests = _grid_world(ranks, **CASES[case])
    assert plans and all(isinstance(plan, GridPlan) for plan in plans)
    engine, programs = CopyEngine(native=True), {}
    for _ in range(2):  # the second pass reuses the programs
        for plan in plans:
            src, dst = world.prefill_buffers[plan.src_rank], world.decode_buffers[plan.dst_rank]
            assert "batches" not in plan.__dict__
            assert engine.execute(plan, src, dst, programs=programs) == plan.total_nbytes
            assert "batches" not in plan.__dict__  # copied without lowering
    assert programs
    assert world.verify(requests) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_grid_plan_lowers_on_demand_for_any_other_writer(ranks, case):
    world, plans, requests = _grid_world(ranks, **CASES[case])
    engine = CopyEngine(native=False)  # numpy tasks: they read the lowered batches
    for plan in plans:
        assert (
            engine.execute(plan, world.prefill_buffers[plan.src_rank], world.decode_buffers[plan.dst_rank])
            == plan.total_nbytes
        )
        assert sum(b.total_nbytes for b in plan.batches) == plan.total_nbytes
        assert sum(b.num_runs for b in plan.batches) <= plan.num_runs
    assert world.verify(requests) == []


@needs_native
@pytest.mark.parametrize("side", ["source", "destination"])
def test_a_region_too_short_for_the_grid_refuses_the_plan_and_writes_nothing(ranks, side):
    world, plans, _ = _grid_world(ranks, "llama", 2, 2)
    plan = plans[0]
    src = dict(world.prefill_buffers[plan.src_rank])
    dst = dict(world.decode_buffers[plan.dst_rank])
    regions = src if side == "source" else dst
    region_id = (
        plan.grids[0].group.units[-1].src_region
        if side == "source"
        else plan.grids[0].group.units[-1].dst_region
    )
    # source page 5 and destination page 7 of 8-page pools are in the plan: cut the
    # region after 5 pages
    regions[region_id] = regions[region_id][: regions[region_id].size * 5 // 8]
    before = {k: v.copy() for k, v in dst.items()}
    with pytest.raises(TransportError) as info:
        CopyEngine(native=True).execute(plan, src, dst, programs={})
    assert info.value.code is Reason.RUN_OUT_OF_REGION
    assert f"{side} region {region_id!r}" in str(info.value)
    assert all(np.array_equal(dst[k], before[k]) for k in dst)


@needs_native
def test_a_replaced_region_is_written_at_its_new_address(ranks):
    world, plans, _ = _grid_world(ranks, "llama", 2, 2)
    plan = plans[0]
    src, dst = world.prefill_buffers[plan.src_rank], dict(world.decode_buffers[plan.dst_rank])
    engine, programs = CopyEngine(native=True), {}
    engine.execute(plan, src, dst, programs=programs)
    region_id = plan.grids[0].group.units[0].dst_region
    old = dst[region_id]
    landed = old.copy()
    old[:] = 0
    new = dst[region_id] = np.zeros_like(old)  # re-registered: same size, new memory
    engine.execute(plan, src, dst, programs=programs)
    written = new != 0
    assert written.any() and np.array_equal(new[written], landed[written])  # the room is here
    assert not old.any()  # not there


@needs_native
def test_a_missing_region_is_named_before_anything_moves(ranks):
    world, plans, _ = _grid_world(ranks, "llama", 2, 2)
    plan = plans[0]
    dst = dict(world.decode_buffers[plan.dst_rank])
    region_id = plan.grids[0].group.units[0].dst_region
    del dst[region_id]
    before = {k: v.copy() for k, v in dst.items()}
    with pytest.raises(TransportError) as info:
        CopyEngine(native=True).execute(plan, world.prefill_buffers[plan.src_rank], dst)
    assert info.value.code is Reason.UNKNOWN_REGION and region_id in str(info.value)
    assert all(np.array_equal(dst[k], before[k]) for k in dst)


def test_only_small_requests_become_grid_plans(ranks):
    _, _, requests = _grid_world(ranks, "llama", 2, 2)
    prefill = ranks("llama", Role.PREFILL, 2, Layout.NHD, 8)
    decode = ranks("llama", Role.DECODE, 2, Layout.NHD, 8)
    planner = PairPlanner(reconcile(prefill, decode), prefill[0], decode[0])
    runs = planner.plan(requests, grid_max_runs=1 << 20).num_runs
    assert isinstance(planner.plan(requests, grid_max_runs=runs), GridPlan)
    assert not isinstance(planner.plan(requests, grid_max_runs=runs - 1), GridPlan)
    assert not isinstance(planner.plan(requests), GridPlan)
    assert not isinstance(planner.plan(requests, layers=[0], grid_max_runs=1 << 20), GridPlan)
