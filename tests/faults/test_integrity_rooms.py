"""Integrity checks with real sidecars: decode verifies every block, a corrupted write fails its room.

Deployments of the tiny GQA model (tests/faults/fault_tools.py) with
``integrity = true``. Corruption comes from the test-only
``fault_corrupt_nth``: each prefill sidecar flips one byte of its Nth data
write, once (:mod:`pd_transfer.transport.fault_injection`: a wrapping transport
writes the inverse of the write's middle byte over it, through shm or tcp
alike). With prefill TP 2 and decode TP 4 every
prefill rank writes a head slice to two decode ranks per room, so with N = 3
the first room is clean, the second carries one bad write per prefill rank
and the third is clean again. Bytes are checked against the sim's content
(pd_transfer.sim.content) item by item.
"""

import numpy as np
from fault_tools import check_sim, fill_sim, metric_total, tiny_ranks

from pd_transfer.client import RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool
from pd_transfer.sim.content import check_destination

NUM_PAGES = 32
SEED = 5


def _requests(room: int) -> dict:
    """Four KV pages and an aux row per room, different pages every room."""
    base = 4 * (room % 8)
    pages = np.arange(base, base + 4, dtype=np.int64)
    return {Pool.KV: (pages, pages[::-1].copy()), Pool.AUX: (np.array([room % 4]), np.array([room % 4]))}


def _run_room(cluster, room: int) -> tuple[dict, dict]:
    requests = _requests(room)
    cluster.expect(room, requests)
    cluster.send(room, requests)
    return requests, cluster.wait_decode(room, timeout_s=30)


def _clean(cluster, room: int) -> None:
    requests, states = _run_room(cluster, room)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert check_sim(cluster, SEED, requests) == []


def test_corrupted_write_fails_its_room_with_integrity_mismatch_and_sidecars_keep_serving(deployment):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 2, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 4, num_pages=NUM_PAGES),
        config={"integrity": True, "fault_corrupt_nth": 3},
    )
    fill_sim(cluster, SEED)
    _clean(cluster, 1)

    requests, states = _run_room(cluster, 2)
    failed = {rank: s for rank, s in states.items() if s.status is not RoomStatus.SUCCESS}
    # one bad write per prefill rank, each into one of the two decode ranks it feeds
    assert 1 <= len(failed) <= 2, (states, cluster.logs())
    for rank, state in failed.items():
        assert state.status is RoomStatus.FAILED and state.code is Reason.INTEGRITY_MISMATCH, state
        assert "integrity mismatch in what prefill[pp0,tp" in state.reason, state.reason
        assert "first bad block: " in state.reason and " in region " in state.reason, state.reason
        geometry = next(g for g in cluster.decode if g.rank_id == rank)
        assert check_destination(geometry, cluster.pools[rank].arrays, SEED, requests) != []
    for geometry in cluster.decode:  # the decode ranks that succeeded hold exactly the right bytes
        if geometry.rank_id not in failed:
            assert check_destination(geometry, cluster.pools[geometry.rank_id].arrays, SEED, requests) == []
    for rank in failed:
        _, text = cluster.http(rank, "/metrics")
        assert metric_total(text, "pd_transfer_transfer_failures_total", reason="integrity_mismatch") == 1

    _clean(cluster, 3)  # both sides still serve; the fault fired once


def test_one_sided_integrity_moves_rooms_unchecked(deployment):
    # decode asks for checks, prefill does not compute them: the room goes ahead (and the
    # corrupted byte really landed), the decode sidecar logs that rooms are not verified
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 1, num_pages=NUM_PAGES),
        config={"fault_corrupt_nth": 1},
        decode_config={"integrity": True},
    )
    fill_sim(cluster, SEED)
    requests, states = _run_room(cluster, 1)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), states
    assert check_sim(cluster, SEED, requests) != []
    decode_log = cluster.sidecars[cluster.decode[0].rank_id].log.read_text()
    assert (
        "integrity: rooms from prefill[pp0,tp0] are not verified: the prefill sidecar does not send checksums"
    ) in decode_log


def test_tcp_corrupted_payload_fails_its_room_with_integrity_mismatch(deployment):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 2, num_pages=NUM_PAGES),
        transport="tcp",
        config={"integrity": True, "fault_corrupt_nth": 2},
    )
    fill_sim(cluster, SEED)
    # payload chunks per room depend on the chunk size: run rooms until the bad one
    for room in range(1, 5):
        requests, states = _run_room(cluster, room)
        failed = [s for s in states.values() if s.status is not RoomStatus.SUCCESS]
        if failed:
            break
        assert check_sim(cluster, SEED, requests) == []
    assert len(failed) == 1, (states, cluster.logs())
    assert failed[0].code is Reason.INTEGRITY_MISMATCH, failed[0]
    assert "integrity mismatch in what prefill[pp0,tp0]" in failed[0].reason
    _clean(cluster, room + 1)
