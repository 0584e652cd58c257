"""The simulated engines end to end, in-process, against a fake pair of sidecars."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from fake_pair import FakePair
from sim_models import tiny

from pd_transfer.client import AsyncClient, Client, ReplyTimeout
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.rank_builder import WorkerShape, build_rank
from pd_transfer.layout.views import Layout
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.sim.bookkeeping import EngineOptions
from pd_transfer.sim.decode import run_decode
from pd_transfer.sim.prefill import run_prefill
from pd_transfer.sim.report import WorkerReport
from pd_transfer.sim.schedule import PoolSizes, ScheduleSpec, build_schedule

NUM_PAGES = 24
BOOTSTRAP = "tcp://127.0.0.1:5999"
SEGMENTS: dict[str, np.ndarray] = {}


def _resolve(name: str, nbytes: int) -> np.ndarray:
    array = SEGMENTS[name]
    assert array.size >= nbytes
    return array


def _rank(kind, role, tp_size, tp_rank, layout=Layout.NHD):
    spec = tiny(kind)
    return build_rank(
        spec,
        WorkerShape(
            role=role,
            tp_size=tp_size,
            tp_rank=tp_rank,
            page_size=4,
            kv_layout=layout,
            num_pages=NUM_PAGES,
            num_aux_rows=3,
            num_slots=3 if spec.linear else None,
        ),
    )


def _schedule(kind, num_requests=7):
    spec = tiny(kind)
    sizes = PoolSizes(NUM_PAGES, NUM_PAGES, 3, 3)
    return build_schedule(
        ScheduleSpec(
            seed=5,
            num_requests=num_requests,
            tokens=21,
            page_size=4,
            window=3,
            prefill=sizes,
            decode=sizes,
            swa_pages_per_request=spec.swa_pages_per_request(4),
            uses_state=spec.linear is not None,
        )
    )


def _run(
    pair: FakePair,
    kind: str,
    prefill_tp: int,
    decode_tp: int,
    options: EngineOptions,
    decode_layout=Layout.NHD,
    num_requests=7,
):
    schedule = _schedule(kind, num_requests)
    reports, threads, handles = {}, [], {}

    def arrays_for(geometry):
        arrays = {}
        for region in geometry.regions:
            name = f"{geometry.rank_id}/{region.id}"
            SEGMENTS[name] = arrays[region.id] = np.zeros(region.nbytes, np.uint8)
            handles.setdefault(geometry.rank_id, {})[region.id] = name
        return arrays

    def prefill(tp_rank):
        geometry = _rank(kind, Role.PREFILL, prefill_tp, tp_rank)
        arrays = arrays_for(geometry)
        report = reports[geometry.rank_id] = WorkerReport("prefill", "p", geometry.rank_id, "", len(schedule))
        with Client(pair.prefill[tp_rank].endpoint, f"p{tp_rank}") as client:
            client.register(geometry, handles[geometry.rank_id])
            run_prefill(client, geometry, arrays, schedule, options, report)

    def decode(tp_rank):
        geometry = _rank(kind, Role.DECODE, decode_tp, tp_rank, decode_layout)
        arrays = arrays_for(geometry)
        report = reports[geometry.rank_id] = WorkerReport("decode", "d", geometry.rank_id, "", len(schedule))

        async def main():
            async with AsyncClient(pair.decode[tp_rank].endpoint, f"d{tp_rank}") as client:
                await client.register(geometry, handles[geometry.rank_id])
                await run_decode(client, geometry, arrays, schedule, options, report)

        asyncio.run(main())

    errors = []

    def guarded(target, *args):
        try:
            target(*args)
        except BaseException as err:  # surfaced below
            errors.append(err)

    for r in range(prefill_tp):
        threads.append(threading.Thread(target=guarded, args=(prefill, r)))
    for r in range(decode_tp):
        threads.append(threading.Thread(target=guarded, args=(decode, r)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]
    return reports


@pytest.fixture
def pair_factory():
    pairs = []

    def make(num_prefill, num_decode):
        pairs.append(FakePair(num_prefill, num_decode, _resolve))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()
    SEGMENTS.clear()


@pytest.mark.parametrize(
    ("kind", "prefill_tp", "decode_tp", "layout"),
    [("gqa", 1, 2, Layout.NHD), ("gdn", 2, 1, Layout.NHD), ("swa", 2, 2, Layout.PAGE_FIRST)],
)
def test_engines_move_and_verify_every_room(pair_factory, kind, prefill_tp, decode_tp, layout):
    pair = pair_factory(prefill_tp, decode_tp)
    reports = _run(
        pair,
        kind,
        prefill_tp,
        decode_tp,
        EngineOptions(chunk_pages=2, room_timeout_s=5, bootstrap_addr=BOOTSTRAP),
        decode_layout=layout,
    )
    for rank_id, report in reports.items():
        summary = report.to_dict()
        assert summary["ok"], (rank_id, summary)
        assert summary["succeeded"] == 7
    decode_bytes = sum(r.nbytes_verified for r in reports.values() if r.role == "decode")
    prefill_bytes = sum(r.nbytes_filled for r in reports.values() if r.role == "prefill")
    # every sharded byte filled on prefill is verified once on decode, whatever the TP
    # sizes; the replicated aux row (192 bytes) is filled and checked on every rank
    aux_nbytes = 7 * 192
    assert decode_bytes - decode_tp * aux_nbytes == prefill_bytes - prefill_tp * aux_nbytes > 0
    latencies = [r.to_dict()["latencies_s"] for r in reports.values() if r.role == "decode"]
    assert all(len(lat) == 7 and all(x >= 0 for x in lat) for lat in latencies)


def test_prefill_sends_in_chunks_with_state_and_aux_last(pair_factory):
    pair = pair_factory(1, 1)
    _run(
        pair,
        "gdn",
        1,
        1,
        EngineOptions(chunk_pages=2, room_timeout_s=5, bootstrap_addr=BOOTSTRAP),
        num_requests=1,
    )
    room = pair.rooms[_schedule("gdn", 1)[0].room]
    sent = room.sent["prefill[pp0,tp0]"]
    assert len(sent["pages"]) == 6 and sent["state_slots"] == [0] and sent["aux_row"] == 0


def test_decode_reports_a_corrupted_room(pair_factory):
    pair = pair_factory(1, 1)
    bad = _schedule("gqa")[4].room
    pair.corrupt_rooms.add(bad)
    reports = _run(
        pair, "gqa", 1, 1, EngineOptions(chunk_pages=3, room_timeout_s=5, bootstrap_addr=BOOTSTRAP)
    )
    decode = reports["decode[pp0,tp0]"].to_dict()
    assert not decode["ok"]
    assert decode["succeeded"] == 7
    assert decode["num_mismatches"] == 1
    assert decode["mismatches"][0].startswith("decode[pp0,tp0] kv.layer[0].k page dst=")
    assert reports["prefill[pp0,tp0]"].to_dict()["ok"]


def test_a_room_that_never_finishes_fails_with_a_timeout(pair_factory):
    pair = pair_factory(1, 1)
    stuck = _schedule("gqa", 2)[1].room
    pair.hang_rooms.add(stuck)
    reports = _run(
        pair,
        "gqa",
        1,
        1,
        EngineOptions(chunk_pages=8, room_timeout_s=0.3, bootstrap_addr=BOOTSTRAP),
        num_requests=2,
    )
    for report in reports.values():
        summary = report.to_dict()
        assert not summary["ok"]
        assert summary["failed"] == [
            {
                "room": stuck,
                "index": 1,
                "status": "timeout",
                "code": "timeout",
                "reason": "still waiting_for_input after waiting 0.3 s",
            }
        ]


def test_a_silent_sidecar_ends_the_decode_run_with_one_timeout(pair_factory):
    pair = pair_factory(1, 1)
    pair.silent_ops.add(WorkerOp.EXPECT)
    geometry = _rank("gqa", Role.DECODE, 1, 0)
    arrays = {r.id: np.zeros(r.nbytes, np.uint8) for r in geometry.regions}
    report = WorkerReport("decode", "d", geometry.rank_id, "", 7)

    async def main():
        async with AsyncClient(pair.decode[0].endpoint, "d0", timeout_s=0.2) as client:
            await run_decode(
                client, geometry, arrays, _schedule("gqa"), EngineOptions(bootstrap_addr=BOOTSTRAP), report
            )

    with pytest.raises(ReplyTimeout, match="expect: no reply from the sidecar"):
        asyncio.run(main())
    assert report.outcomes == []


def test_decode_retires_a_slot_whose_abort_does_not_drain(pair_factory):
    pair = pair_factory(1, 1)
    pair.drained = False
    schedule = _schedule("gqa")
    pair.hang_rooms.add(schedule[1].room)
    reports = _run(
        pair, "gqa", 1, 1, EngineOptions(chunk_pages=8, room_timeout_s=0.3, bootstrap_addr=BOOTSTRAP)
    )
    # slot 1 holds requests 1 and 4 (window 3); other slots may time out too, since the
    # prefill side spends 0.3 s on every stuck room before moving on
    failed = [f for f in reports["decode[pp0,tp0]"].to_dict()["failed"] if f["index"] % 3 == 1]
    assert [(f["index"], f["status"]) for f in failed] == [(1, "timeout"), (4, "failed")]
    assert failed[1]["reason"] == (
        f"not started: room {schedule[1].room} on the same pages ended "
        f"timeout and its abort did not confirm the pages drained"
    )
