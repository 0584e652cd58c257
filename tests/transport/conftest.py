"""Scenarios for the transport tests: a World (the oracle), its plans and requests.

The oracle's numpy buffers are the memory the transports copy between, and
``world.verify(requests)`` says byte for byte whether the destination is right
(and nothing else changed). Exposed as fixtures so the tests work under any
pytest import mode.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import numpy as np
import pytest

from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.memory.segments import SEGMENT_DIR, create_segment
from pd_transfer.testing import World

MODELS = {
    # Llama-3.1-8B's attention geometry (8 KV heads x 128, bf16), three layers:
    # a TP 2 page row is 16 KiB, a TP 2 -> 4 piece 512 B at a 1 KiB stride.
    "llama": {
        "name": "mini-llama",
        "num_layers": 3,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 8, "head_dim": 128},
    },
    "gdn": {
        "name": "tiny-gdn",
        "num_layers": 4,
        "layer_cycle": ["gdn", "gdn", "gdn", "attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 8},
        "gdn": {
            "num_key_heads": 8,
            "key_head_dim": 2,
            "num_value_heads": 16,
            "value_head_dim": 2,
            "conv_kernel": 4,
        },
    },
}


@dataclass
class Scenario:
    world: World
    plans: list
    requests: dict

    def src(self, plan) -> dict[str, np.ndarray]:
        return self.world.prefill_buffers[plan.src_rank]

    def dst(self, plan) -> dict[str, np.ndarray]:
        return self.world.decode_buffers[plan.dst_rank]

    def dst_geometry(self, plan) -> RankGeometry:
        return self.world.decode[plan.dst_rank]


def instance(kind: str, role: Role, tp: int, layout: Layout, num_pages: int) -> list[RankGeometry]:
    spec = model_from_table(dict(MODELS[kind]), f"<test {kind}>")
    return build_instance(
        spec, role, tp, page_size=16, kv_layout=layout, num_pages=num_pages, num_slots=3, num_aux_rows=2
    )


def build_scenario(
    kind: str = "llama",
    prefill_tp: int = 2,
    decode_tp: int = 2,
    *,
    src_layout: Layout = Layout.NHD,
    dst_layout: Layout = Layout.NHD,
    num_pages: int = 12,
    seed: int = 0,
) -> Scenario:
    prefill = instance(kind, Role.PREFILL, prefill_tp, src_layout, num_pages)
    decode = instance(kind, Role.DECODE, decode_tp, dst_layout, num_pages)
    recon = reconcile(prefill, decode)
    if not recon.ok:
        raise AssertionError(f"scenario must reconcile:\n{recon.error()}")
    rng = np.random.default_rng(seed)
    requests = {}
    for pool in Pool:
        src = [v.index_count for g in prefill for v in g.views if v.pool is pool]
        dst = [v.index_count for g in decode for v in g.views if v.pool is pool]
        if src and dst:
            n = 1 if pool in (Pool.MAMBA, Pool.AUX) else min(min(src), min(dst)) - 2
            requests[pool] = (rng.choice(min(src), n, replace=False), rng.choice(min(dst), n, replace=False))
    by_id = {g.rank_id: g for g in prefill}
    plans = [
        plan_pair(recon, by_id[src_id], dst, requests) for dst in decode for src_id in recon.sources_for(dst)
    ]
    return Scenario(World.build(prefill, decode, seed), plans, requests)


@pytest.fixture
def scenario():
    """``scenario(kind, prefill_tp, decode_tp, dst_layout=..., ...)`` -> :class:`Scenario`."""
    return build_scenario


@pytest.fixture
def ranks():
    """``ranks(kind, role, tp, layout, num_pages)`` -> every rank's geometry of one instance."""
    return instance


@pytest.fixture
def segments():
    """``segments(regions)`` copies regions into fresh shm segments: ``{region: Segment}``.

    Every segment is closed and unlinked at teardown.
    """
    made = []
    tag = uuid.uuid4().hex[:8]

    def make(regions: dict[str, np.ndarray]) -> dict:
        out = {}
        for region_id, buf in regions.items():
            segment = create_segment(f"pdt-test-{tag}-{len(made)}", buf.size)
            segment.array[:] = buf
            made.append(segment)
            out[region_id] = segment
        return out

    yield make
    for segment in made:
        segment.close()
        segment.unlink()
    leftovers = [n for n in os.listdir(SEGMENT_DIR) if n.startswith(f"pdt-test-{tag}")]
    assert leftovers == [], f"segments left behind: {leftovers}"
