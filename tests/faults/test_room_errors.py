"""Faults that must end one room with its reason, never the sidecar or a later room.

Real sidecar processes (tests/agent/cluster.py), a 2-layer model, shm on one
host. A segment truncated under the prefill's mapping, an index far outside the
pool, rooms that overlap, a decode stopped long enough to be declared lost, and
a decode that never confirms: each fails where and when it should, with a
reason, and the sidecars keep serving.
"""

import os
import signal
import time

import pytest
from fault_tools import check_sim, fill_sim, kv_requests, tiny_ranks, wait_for, wait_status

from pd_transfer.client import Refused, RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.memory.segments import SEGMENT_DIR

SEED = 5


def _pair(deployment, **config):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1), tiny_ranks(Role.DECODE, 1), config={"bootstrap_timeout_s": 3.0, **config}
    )
    fill_sim(cluster, SEED)
    return (cluster, cluster.clients[cluster.prefill[0].rank_id], cluster.clients[cluster.decode[0].rank_id])


def _room_lands(cluster, room: int, src, dst) -> None:
    requests = kv_requests(src, dst)
    cluster.expect(room, requests)
    cluster.send(room, requests)
    state = cluster.clients[cluster.decode[0].rank_id].wait(room, timeout_s=15)
    assert state.status is RoomStatus.SUCCESS, state.reason
    assert check_sim(cluster, SEED, requests) == []


def _alive(cluster, role: Role) -> bool:
    ranks = cluster.prefill if role is Role.PREFILL else cluster.decode
    return cluster.sidecars[ranks[0].rank_id].proc.poll() is None


def test_a_decode_segment_truncated_under_the_prefill_fails_the_room_not_the_sidecar(deployment):
    cluster, _, decode = _pair(deployment)
    _room_lands(cluster, 1, [0, 1], [2, 3])  # the prefill has the segments mapped
    pools = cluster.pools[cluster.decode[0].rank_id]
    region_id, segment = next(iter(pools.handles.items()))
    path = os.path.join(SEGMENT_DIR, segment)
    size = os.path.getsize(path)
    os.truncate(path, 0)  # the peer shrinks what it registered
    try:
        requests = kv_requests([4, 5, 6], [7, 8, 9])
        cluster.expect(2, requests)
        cluster.send(2, requests)
        state = decode.wait(2, timeout_s=10)
    finally:
        os.truncate(path, size)  # zeros again, and mappable
    assert _alive(cluster, Role.PREFILL), "the prefill sidecar died (SIGBUS)"
    assert state.status is RoomStatus.FAILED
    assert state.code_text == "segment_truncated", state.reason
    assert segment in state.reason
    # the peer was dropped with its mapping; the next sessions map the segment afresh
    time.sleep(0.5)
    _room_lands(cluster, 3, [10, 11], [12, 13])
    assert "truncated its segment" in cluster.sidecars[cluster.prefill[0].rank_id].log.read_text()


def test_a_prefill_pool_truncated_by_its_own_worker_fails_the_room_not_the_sidecar(deployment):
    cluster, prefill, decode = _pair(deployment)
    _room_lands(cluster, 1, [0, 1], [2, 3])
    pools = cluster.pools[cluster.prefill[0].rank_id]
    segment = next(iter(pools.handles.values()))
    path = os.path.join(SEGMENT_DIR, segment)
    size = os.path.getsize(path)
    os.truncate(path, 0)
    try:
        requests = kv_requests([4, 5], [6, 7])
        cluster.expect(2, requests)
        cluster.send(2, requests)
        state = decode.wait(2, timeout_s=10)
    finally:
        os.truncate(path, size)
    assert _alive(cluster, Role.PREFILL), "the prefill sidecar died (SIGBUS)"
    assert state.status is RoomStatus.FAILED and state.code_text == "segment_truncated", state
    assert prefill.poll(2).code_text == "segment_truncated"


def test_a_prefill_worker_that_truncated_its_pool_is_unready_until_its_new_registration(deployment):
    cluster, prefill, decode = _pair(deployment)
    rank = cluster.prefill[0].rank_id
    _room_lands(cluster, 1, [0, 1], [2, 3])
    pools = cluster.pools[rank]
    segment = next(iter(pools.handles.values()))
    path = os.path.join(SEGMENT_DIR, segment)
    size = os.path.getsize(path)
    os.truncate(path, 0)
    try:
        requests = kv_requests([4, 5], [6, 7])
        cluster.expect(2, requests)
        cluster.send(2, requests)
        assert decode.wait(2, timeout_s=10).code_text == "segment_truncated"
    finally:
        os.truncate(path, size)
    status, body = cluster.http(rank, "/readyz")  # not ready, and why
    assert status == 503 and segment in body and "registers new pools" in body, body
    prefill.close()  # the worker lets go of its pools, then registers new ones
    wait_for(lambda: "register again" in cluster.http(rank, "/readyz")[1], 60, "the pools released")
    pools.close()
    cluster._attach(cluster.prefill[0], f"{cluster._tag}-again")
    fill_sim(cluster, SEED)
    wait_for(lambda: cluster.http(rank, "/readyz")[0] == 200, 60, "prefill /readyz 200 again")
    _room_lands(cluster, 3, [8, 9], [10, 11])  # not segment_truncated naming the old segment


def test_a_decode_pool_truncated_by_its_worker_fails_tcp_rooms_not_the_decode_sidecar(deployment):
    """tcp: the decode sidecar itself writes into its worker's pools (its receiver)."""
    cluster, _, decode = _pair(deployment, transport="tcp")
    _room_lands(cluster, 1, [0, 1], [2, 3])
    pools = cluster.pools[cluster.decode[0].rank_id]
    segment = next(iter(pools.handles.values()))
    path = os.path.join(SEGMENT_DIR, segment)
    size = os.path.getsize(path)
    os.truncate(path, 0)
    try:
        states = []
        for room in (2, 3):  # the mapping holds zeros from then on: every room fails
            requests = kv_requests([4, 5], [6 + room, 10 + room])
            cluster.expect(room, requests)
            cluster.send(room, requests)
            states.append(decode.wait(room, timeout_s=10))
    finally:
        os.truncate(path, size)
    assert _alive(cluster, Role.DECODE), "the decode sidecar died (SIGBUS)"
    for state in states:
        assert state.status is RoomStatus.FAILED, state
        assert state.code_text == "segment_truncated", state.reason


@pytest.mark.parametrize(
    "pages", [[2**40 + 1], [0, 16], [3, 2**62 - 1]], ids=["2**40", "one-past", "last-of-two"]
)
def test_an_index_outside_the_pool_is_refused_at_expect_with_the_field(deployment, pages):
    cluster, prefill, decode = _pair(deployment)
    started = time.monotonic()
    with pytest.raises(Refused) as refused:
        decode.expect(7, cluster.bootstrap, pages)
    assert time.monotonic() - started < 2.0
    assert refused.value.code_text == "index_out_of_range"
    assert "at $.pages[" in str(refused.value) and "pool of 16" in str(refused.value)
    with pytest.raises(Refused) as refused:  # the prefill worker's send too
        prefill.send(8, pages)
    assert refused.value.code_text == "index_out_of_range"
    _room_lands(cluster, 9, [0], [1])  # and both keep serving


def test_overlapping_rooms_and_repeated_destination_pages_are_refused(deployment):
    cluster, _, decode = _pair(deployment)
    decode.expect(1, cluster.bootstrap, [1, 2])
    with pytest.raises(Refused) as refused:
        decode.expect(2, cluster.bootstrap, [2, 3])
    assert refused.value.code_text == "index_in_use"
    assert "live room 1" in str(refused.value)
    with pytest.raises(Refused) as refused:
        decode.expect(3, cluster.bootstrap, [4, 5, 4])
    assert refused.value.code_text == "index_repeated"
    assert "index 4" in str(refused.value)
    assert decode.abort(1)  # room 1 ends: its pages are free
    _room_lands(cluster, 2, [0, 1], [2, 3])


def test_a_decode_stopped_past_its_heartbeat_limit_serves_the_next_room(deployment):
    cluster, _, decode = _pair(deployment)
    _room_lands(cluster, 1, [0, 1], [2, 3])
    decode_proc = cluster.sidecars[cluster.decode[0].rank_id].proc
    os.kill(decode_proc.pid, signal.SIGSTOP)
    time.sleep(3.0)  # 3 x the 1 s heartbeat limit: prefill drops the session
    os.kill(decode_proc.pid, signal.SIGCONT)
    _room_lands(cluster, 2, [4, 5], [6, 7])


def test_prefill_succeeds_only_once_decode_has_the_bytes(deployment):
    cluster, prefill, decode = _pair(deployment)
    _room_lands(cluster, 1, [0, 1], [2, 3])
    decode_sidecar = cluster.sidecars[cluster.decode[0].rank_id]
    decode.expect(2, cluster.bootstrap, [4, 5])
    wait_status(decode, 2, [RoomStatus.WAITING_FOR_INPUT])
    os.kill(decode_sidecar.proc.pid, signal.SIGSTOP)  # it cannot take in the Done now
    try:
        prefill.send(2, [6, 7])
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # the bytes are written (shm) ...
            assert prefill.poll(2).status is not RoomStatus.SUCCESS  # ... but not confirmed
            time.sleep(0.05)
    finally:
        decode_sidecar.kill()  # dies without confirming
    state = wait_for(
        lambda: (s := prefill.poll(2)).status in (RoomStatus.SUCCESS, RoomStatus.FAILED) and s,
        10.0,
        "prefill room 2 ending",
    )
    assert state.status is RoomStatus.FAILED, state
    assert state.code_text in ("peer_lost", "timeout"), state.reason
