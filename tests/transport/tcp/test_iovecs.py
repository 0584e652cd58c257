"""I/O vectors: the parts a chunk is sent from and received into hold exactly its payload."""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.layout.views import Layout
from pd_transfer.transport.copy.packing import gather_chunk, layout_chunks, scatter_chunk
from pd_transfer.transport.regions import map_one
from pd_transfer.transport.tcp.iovecs import (
    Staging,
    destination_parts,
    finish,
    join,
    source_parts,
)
from pd_transfer.transport.tcp.sockets import IOV_MAX


def test_join_makes_continuing_runs_one():
    offset, nbytes = join(np.array([0, 16, 32, 100, 116]), np.array([16, 16, 8, 16, 4]))
    assert offset.tolist() == [0, 100] and nbytes.tolist() == [40, 20]


@pytest.mark.parametrize("direct_min", [1, 4096, 1 << 30], ids=["in-place", "mixed", "staged"])
@pytest.mark.parametrize("stage_nbytes", [1000, 8192, 2 << 20])
@pytest.mark.parametrize(
    "case",
    [
        dict(kind="llama", prefill_tp=2, decode_tp=4),
        dict(kind="llama", prefill_tp=4, decode_tp=2, dst_layout=Layout.PAGE_FIRST),
        dict(kind="gdn", prefill_tp=2, decode_tp=4),
    ],
    ids=["sliced", "converted", "gdn"],
)
def test_parts_carry_exactly_the_payload(scenario, case, direct_min, stage_nbytes):
    sc = scenario(**case)
    for plan in sc.plans:
        src = {r: map_one(r, b, "source") for r, b in sc.src(plan).items()}
        expected_dst = {r: b.copy() for r, b in sc.dst(plan).items()}
        got_dst = {r: map_one(r, b.copy(), "destination") for r, b in sc.dst(plan).items()}
        want_dst = {r: map_one(r, b, "destination") for r, b in expected_dst.items()}
        layouts = layout_chunks(plan, {r: m.nbytes for r, m in src.items()}, 256 << 10)
        staging_out, staging_in = Staging(), Staging()
        for layout in layouts:
            payload = gather_chunk(layout, src)
            sent = []
            for part in source_parts(layout, src, staging_out, direct_min, stage_nbytes):
                assert 0 < part.num_iov <= 2 * IOV_MAX
                sent.append(b"".join(bytes(v) for v in part.views()))  # sent before the next
                iov = part.iov()
                assert iov[:, 1].sum() == len(sent[-1])
            assert b"".join(sent) == payload.tobytes()
            at = 0
            for part in destination_parts(layout.wire, got_dst, staging_in, direct_min, stage_nbytes):
                for view in part.views():  # "receive" the payload's next bytes into the part
                    view[:] = payload[at : at + len(view)]
                    at += len(view)
                finish(part)
            assert at == payload.size
            scatter_chunk(layout.wire, payload, want_dst)
        for region_id, mapped in got_dst.items():
            assert np.array_equal(mapped.array, expected_dst[region_id]), region_id


def _wire_of(run_nbytes: int, count: int = 64):
    """One chunk of ``count`` runs of ``run_nbytes`` at scattered offsets, both sides."""
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    offsets = np.arange(count, dtype=np.int64)[::-1] * 2 * run_nbytes
    plan = TransferPlan(
        "p",
        "d",
        (
            RunBatch(
                "src",
                "dst",
                offsets,
                offsets,
                np.full(count, run_nbytes, np.int64),
                np.ones(count, np.int64),
                0,
                0,
            ),
        ),
    )
    size = 2 * run_nbytes * count
    return layout_chunks(plan, {"src": size}, 8 << 20)[0], size


@pytest.mark.parametrize(
    "run_nbytes, staged_in, staged_out", [(2048, True, False), (4096, False, False), (512, True, True)]
)
def test_default_thresholds_stage_small_runs_on_receipt_first(run_nbytes, staged_in, staged_out):
    """Sending, the kernel reads 2 KiB runs in place; receiving, they are staged and
    scattered (the kernel's writes into small scattered runs cost more than its reads);
    from 4 KiB both sides go in place, below 1 KiB both stage."""
    from pd_transfer.transport.copy import native_loop as native_copy
    from pd_transfer.transport.tcp import native_io

    if not (native_io.AVAILABLE and native_copy.AVAILABLE):
        pytest.skip("the thresholds under test are those of the native iovec path and copy loop")
    layout, size = _wire_of(run_nbytes)
    src = {"src": map_one("src", np.zeros(size, np.uint8), "source")}
    dst = {"dst": map_one("dst", np.zeros(size, np.uint8), "destination")}
    out = list(source_parts(layout, src, Staging()))
    into = list(destination_parts(layout.wire, dst, Staging()))
    assert any(part.staged_nbytes for part in out) is staged_out
    assert any(part.staged for part in into) is staged_in
