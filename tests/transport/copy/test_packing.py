"""Gather on one side, scatter on the other: the tcp halves reproduce the oracle exactly."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.views import Layout
from pd_transfer.transport.copy.packing import WireRuns, check_wire, gather, layout_chunks, scatter


@pytest.mark.parametrize("chunk_nbytes", [300, 4096, 64 << 10, 64 << 20])
@pytest.mark.parametrize(
    "case",
    [
        dict(kind="llama", prefill_tp=2, decode_tp=4),
        dict(kind="llama", prefill_tp=4, decode_tp=2, dst_layout=Layout.PAGE_FIRST),
        dict(kind="gdn", prefill_tp=2, decode_tp=4),
    ],
    ids=["sliced", "converted", "gdn"],
)
def test_gather_then_scatter_matches_oracle(scenario, case, chunk_nbytes):
    sc = scenario(**case)
    for plan in sc.plans:
        sent = 0
        for wire, payload in gather(plan, sc.src(plan), chunk_nbytes):
            assert payload.size <= chunk_nbytes
            sent += scatter(wire, payload, sc.dst(plan))
        assert sent == plan.total_nbytes
    assert sc.world.verify(sc.requests) == []


def test_destination_contiguous_pieces_travel_as_one_run(scenario):
    # decode tp 4 takes 2 of prefill tp 2's 4 heads: 16 pieces of 512 B per K page,
    # back to back in the destination page, so the header names one 8 KiB run
    sc = scenario("llama", 2, 4)
    plan = sc.plans[0]
    layouts = layout_chunks(plan, {k: v.size for k, v in sc.src(plan).items()}, 64 << 20)
    kv_runs = np.concatenate(
        [
            layout.wire.runs[[layout.wire.regions[slot].startswith("kv.") for slot in layout.wire.runs[:, 0]]]
            for layout in layouts
        ]
    )
    kv_pieces = sum(int(b.count.sum()) for b in plan.batches if b.dst_region.startswith("kv."))
    assert kv_pieces == 16 * len(kv_runs)
    assert (kv_runs[:, 2] == 8192).all()


def _wire(rows, regions=("kv",)) -> WireRuns:
    return WireRuns(tuple(regions), np.array(rows, np.int64).reshape(-1, 3))


@pytest.mark.parametrize(
    "rows,regions,payload,code",
    [
        ([[0, 4090, 16]], ("kv",), 16, Reason.RUN_OUT_OF_REGION),
        ([[0, -1, 16]], ("kv",), 16, Reason.RUN_OUT_OF_REGION),
        ([[0, 0, 0]], ("kv",), 0, Reason.RUN_OUT_OF_REGION),
        ([[0, 2**62, 2**62]], ("kv",), 0, Reason.RUN_OUT_OF_REGION),
        ([[1, 0, 16]], ("kv",), 16, Reason.BAD_FRAME),
        ([[0, 0, 16]], ("kv",), 15, Reason.BAD_FRAME),
        ([[0, 0, 16]], ("secret",), 16, Reason.UNKNOWN_REGION),
    ],
    ids=["past-end", "negative", "empty-run", "overflow", "bad-slot", "short-payload", "unknown"],
)
def test_check_wire_refuses_runs_outside_registered_regions(rows, regions, payload, code):
    with pytest.raises(TransportError) as info:
        check_wire(_wire(rows, regions), {"kv": 4096}, payload)
    assert info.value.code is code


def test_scatter_refuses_a_bad_chunk_without_writing_any_of_it():
    region = np.zeros(4096, np.uint8)
    wire = _wire([[0, 0, 16], [0, 4090, 16]])
    with pytest.raises(TransportError) as info:
        scatter(wire, np.ones(32, np.uint8), {"kv": region})
    assert info.value.code is Reason.RUN_OUT_OF_REGION
    assert "4090" in str(info.value) and "4096" in str(info.value)
    assert not region.any()
