"""Layer-wise plans: a chunk's transfer cut into batches of ready layers.

Executing the per-layer plans one after another must leave exactly the bytes
the oracle expects, and the layers' plans together must move exactly the
bytes of the whole plan, each once: streaming changes when bytes move, never
which.
"""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Pool
from pd_transfer.testing import World
from tests.layout.transfer_check import instance, random_requests


def _layer_ids(geometry) -> list[int]:
    return sorted({v.layer_id for v in geometry.views if v.layer_id is not None})


def _run_set(plan) -> set[tuple]:
    runs = set()
    for src_region, dst_region, src_off, dst_off, nbytes in plan.byte_runs():
        runs.update(
            zip(
                [src_region] * len(src_off),
                [dst_region] * len(src_off),
                src_off.tolist(),
                dst_off.tolist(),
                nbytes.tolist(),
            )
        )
    return runs


@pytest.mark.parametrize(
    "kind,tp_src,tp_dst", [("gqa", 2, 4), ("mla", 4, 2), ("gdn", 2, 4), ("swa", 1, 2), ("mamba2", 2, 1)]
)
def test_layer_by_layer_plans_deliver_exactly_the_whole_transfer(kind, tp_src, tp_dst):
    prefill, decode = instance(kind, Role.PREFILL, tp_src), instance(kind, Role.DECODE, tp_dst)
    recon = reconcile(prefill, decode)
    requests = random_requests(prefill, decode, np.random.default_rng(3))
    world = World.build(prefill, decode, seed=3)
    by_id = {g.rank_id: g for g in prefill}
    for dst in decode:
        for src_id in recon.sources_for(dst):
            planner = PairPlanner(recon, by_id[src_id], dst)
            whole = planner.plan(requests)
            parts = [planner.plan(requests, layers=[layer]) for layer in _layer_ids(by_id[src_id])]
            rest = planner.plan(requests, layers=[-1])  # tensors with no layer id (aux rows)
            assert sum(p.total_nbytes for p in parts) + rest.total_nbytes == whole.total_nbytes
            union = set().union(*(_run_set(p) for p in parts), _run_set(rest))
            assert union == _run_set(whole)
            for plan in parts + [rest]:
                world.execute(plan)
    assert world.verify(requests) == []


def test_a_layer_filter_keeps_only_that_layers_tensors():
    prefill, decode = instance("gqa", Role.PREFILL, 1), instance("gqa", Role.DECODE, 1)
    recon = reconcile(prefill, decode)
    planner = PairPlanner(recon, prefill[0], decode[0])
    requests = {Pool.KV: (np.array([0, 2]), np.array([1, 3]))}
    plan = planner.plan(requests, layers=[1])
    regions = {b.src_region for b in plan.batches}
    layer1 = {v.region for v in prefill[0].views if v.layer_id == 1 and v.pool is Pool.KV}
    assert plan.total_nbytes > 0 and regions <= layer1
    assert planner.plan(requests, layers=[]).total_nbytes == 0
