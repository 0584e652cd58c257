"""Limits with real sidecar processes: rooms over a limit wait, then succeed or fail
with ``backpressure_timeout``; bytes in flight stay under the total; sidecars keep serving.

Waits are bounded (a few seconds at most); nothing asserts how fast a transfer is.
"""

import time

import numpy as np

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
TERMINAL = (RoomStatus.SUCCESS, RoomStatus.FAILED)


def _ranks(role, tp, **kwargs):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 48, "num_aux_rows": 16, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _room_requests(room: int, pages: int = 2) -> dict:
    """Distinct pages per room (rooms run at once), its own aux row (rooms 0-15 never share one)."""
    first = room * pages
    return {
        Pool.KV: (np.arange(first, first + pages), np.arange(first, first + pages)[::-1].copy()),
        Pool.AUX: (np.array([room % 16]), np.array([room % 16])),
    }


def _merged(*requests: dict) -> dict:
    """Several rooms' requests as one, to check every byte once all of them landed."""
    return {
        pool: tuple(np.concatenate([r[pool][side] for r in requests]) for side in (0, 1))
        for pool in requests[0]
    }


def _metric(cluster, rank_id: str, name: str, **labels) -> float:
    return cluster.metric(rank_id, name, **labels)


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return value


def _statuses(client, rooms) -> list[RoomStatus]:
    return [client.poll(room).status for room in rooms]


def test_rooms_over_max_rooms_per_peer_wait_and_succeed_when_earlier_ones_finish(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(
        prefill, decode, decode_config={"max_rooms_per_peer": 2, "admission_wait_s": 30.0}
    )
    client = cluster.clients[decode[0].rank_id]
    rooms = [1, 2, 3, 4, 5]
    for room in rooms:
        cluster.expect(room, _room_requests(room))
    # two rooms got their slot and asked prefill; three wait for one, still bootstrapping
    _wait_for(
        lambda: _statuses(client, rooms).count(RoomStatus.WAITING_FOR_INPUT) == 2, 10, "two rooms admitted"
    )
    assert _statuses(client, rooms).count(RoomStatus.BOOTSTRAPPING) == 3
    assert _metric(cluster, decode[0].rank_id, "pd_transfer_admission_waiting", resource="rooms") == 3
    for room in rooms:
        cluster.send(room, _room_requests(room))
    for room in rooms:
        state = client.wait(room, timeout_s=20)
        assert state.status is RoomStatus.SUCCESS, state.reason
    assert cluster.verify(_merged(*map(_room_requests, rooms))) == []
    rank = decode[0].rank_id
    assert _metric(cluster, rank, "pd_transfer_admission_peak", resource="rooms") == 2
    assert _metric(cluster, rank, "pd_transfer_admission_in_use", resource="rooms") == 0
    assert _metric(cluster, rank, "pd_transfer_admission_wait_seconds_count", resource="rooms") == 5


def test_rooms_waiting_past_admission_wait_s_fail_with_backpressure_timeout(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(
        prefill, decode, decode_config={"max_rooms_per_peer": 2, "admission_wait_s": 0.5}
    )
    client, rank = cluster.clients[decode[0].rank_id], decode[0].rank_id
    rooms = list(range(1, 11))
    for room in rooms:  # prefill's worker sends nothing yet: the peer is stalled
        cluster.expect(room, _room_requests(room))
    # which two rooms get the slots depends on when each resumed after the bootstrap
    # (rooms expected once it resolved go straight to admission): any two, never more
    states = {room: client.wait(room, timeout_s=3) for room in rooms}
    stalled = [r for r, state in states.items() if state.status is RoomStatus.WAITING_FOR_INPUT]
    excess = [r for r in rooms if r not in stalled]
    assert len(stalled) == 2, states
    for room in excess:
        state = states[room]
        assert state.status is RoomStatus.FAILED and state.code_text == "backpressure_timeout"
        assert "max_rooms_per_peer=2" in state.reason
        assert "raise max_rooms_per_peer or admission_wait_s" in state.reason
    # nothing is left queued, and the limit's refusals are counted
    assert _metric(cluster, rank, "pd_transfer_admission_waiting", resource="rooms") == 0
    assert _metric(cluster, rank, "pd_transfer_limit_rejections_total", limit="max_rooms_per_peer") == len(
        excess
    )
    # the sidecar keeps serving: the stalled rooms finish, then a new room gets a slot
    for room in stalled + [11]:
        if room == 11:
            cluster.expect(room, _room_requests(room))
        cluster.send(room, _room_requests(room))
        state = client.wait(room, timeout_s=15)
        assert state.status is RoomStatus.SUCCESS, state.reason
    assert cluster.verify(_merged(*map(_room_requests, stalled + [11]))) == []


def test_prefill_holds_a_room_slot_per_decode_peer_until_the_room_ends(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(
        prefill,
        decode,
        config={"max_rooms_per_peer": 1, "admission_wait_s": 0.5},
        decode_config={"max_rooms_per_peer": 8},
    )
    sender, client = cluster.clients[prefill[0].rank_id], cluster.clients[decode[0].rank_id]
    first, second = _room_requests(1, 4), _room_requests(4)  # pages 4-7, 8-9
    cluster.expect(1, first)
    cluster.expect(4, second)
    _wait_for(
        lambda: _statuses(client, [1, 4]) == [RoomStatus.WAITING_FOR_INPUT] * 2, 10, "both rooms requested"
    )
    sender.send(1, list(first[Pool.KV][0][:2]), last_chunk=False)  # room 1 writes: holds the slot
    _wait_for(lambda: client.poll(1).status is RoomStatus.TRANSFERRING, 10, "room 1 transferring")
    cluster.send(4, second)
    state = client.wait(4, timeout_s=10)  # decode hears prefill's failure
    assert state.status is RoomStatus.FAILED and state.code_text == "backpressure_timeout"
    assert "max_rooms_per_peer=1" in state.reason and decode[0].rank_id in state.reason
    assert sender.wait(4, timeout_s=5).code_text == "backpressure_timeout"
    sender.send(1, list(first[Pool.KV][0][2:]), aux_row=int(first[Pool.AUX][0][0]))
    assert client.wait(1, timeout_s=10).status is RoomStatus.SUCCESS
    third = _room_requests(5)  # the slot came back when room 1 ended
    cluster.expect(5, third)
    cluster.send(5, third)
    assert client.wait(5, timeout_s=10).status is RoomStatus.SUCCESS
    assert cluster.verify(_merged(first, third)) == []  # room 4 wrote nothing


def test_bytes_in_flight_to_two_decode_peers_stay_under_the_total(cluster_factory):
    # prefill TP 1 feeds decode TP 2: two decode peers, each receiving half of every page's
    # heads. A chunk of 8 pages to one peer is 8 x (2 layers x K,V x 4 tokens x 2 heads x
    # 8 x 2 B) = 4 KiB; a total of 6 KiB lets one such chunk be in flight at a time.
    total_nbytes = 6 * 1024
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 2)
    cluster = cluster_factory(
        prefill,
        decode,
        transport="tcp",
        config={"max_inflight_nbytes_total": total_nbytes, "admission_wait_s": 10.0},
    )
    rooms = {room: _room_requests(room, pages=8) for room in (1, 2, 3, 4)}
    for room, requests in rooms.items():
        cluster.expect(room, requests)
    for room, requests in rooms.items():
        cluster.send(room, requests)
    for room in rooms:
        for rank, state in cluster.wait_decode(room, timeout_s=20).items():
            assert state.status is RoomStatus.SUCCESS, f"{rank}: {state.reason}"
    assert cluster.verify(_merged(*rooms.values())) == []
    rank = prefill[0].rank_id
    peak = _metric(cluster, rank, "pd_transfer_admission_peak", resource="bytes")
    assert 0 < peak <= total_nbytes
    assert _metric(cluster, rank, "pd_transfer_admission_in_use", resource="bytes") == 0
    assert _metric(cluster, rank, "pd_transfer_inflight_bytes") == 0
    assert _metric(cluster, rank, "pd_transfer_admission_wait_seconds_count", resource="bytes") == 8


def test_a_room_over_max_chunks_per_room_fails_with_over_limit_and_others_go_on(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, config={"max_chunks_per_room": 2})
    sender, client = cluster.clients[prefill[0].rank_id], cluster.clients[decode[0].rank_id]
    requests = _room_requests(1, 4)
    cluster.expect(1, requests)
    pages = [int(p) for p in requests[Pool.KV][0]]
    sender.send(1, pages[:1], last_chunk=False)
    sender.send(1, pages[1:2], last_chunk=False)
    sender.send(1, pages[2:3], last_chunk=False)  # the third chunk: one too many
    state = sender.poll(1)
    assert state.status is RoomStatus.FAILED and state.code_text == "over_limit"
    assert "max_chunks_per_room=2" in state.reason
    assert client.wait(1, timeout_s=10).code_text == "over_limit"
    assert (
        _metric(
            cluster, prefill[0].rank_id, "pd_transfer_limit_rejections_total", limit="max_chunks_per_room"
        )
        == 1
    )
    other = _room_requests(3)
    cluster.expect(3, other)
    cluster.send(3, other)
    assert client.wait(3, timeout_s=10).status is RoomStatus.SUCCESS
