"""A sidecar killed mid-transfer fails its rooms with a reason; a restarted one serves again.

One prefill TP 2 / decode TP 1 deployment (each prefill rank writes half of
every page's heads). Each kill comes while a room is Transferring: both
prefill ranks sent the first of two chunks and the second is not sent yet.
Heartbeats are 0.2 s with 5 misses: a lost peer is declared after about a
second (a dead prefill rank, seen from decode, after about 0.2 s: its
connection closes; see test_dropped_connections.py). A restarted sidecar gets the old one's worker endpoint, bootstrap
address and config; its worker (still alive: these are sidecar faults)
registers again, and a new room must succeed without restarting the other
side. Bytes are checked against the sim's content (pd_transfer.sim.content),
item by item for the rooms that succeeded. Each test makes its own kill, on
pages no other test uses, so they run in any order.
"""

import time
from collections import Counter
from pathlib import Path

import pytest
from fault_tools import (
    TERMINAL,
    check_sim,
    fill_sim,
    kv_requests,
    restart_sidecar,
    tiny_ranks,
    wait_status,
)

from pd_transfer.client import Client, RoomStatus
from pd_transfer.layout.geometry import Role

NUM_PAGES = 64
SEED = 11
LOST_WITHIN_S = 5 * 0.2 * 3  # a few heartbeat limits


@pytest.fixture(scope="module")
def cluster(module_deployment):
    cluster = module_deployment(
        tiny_ranks(Role.PREFILL, 2, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 1, num_pages=NUM_PAGES),
        config={"bootstrap_timeout_s": 3.0},
    )
    fill_sim(cluster, SEED)
    return cluster


def _transferring(cluster, room: int) -> None:
    """Start ``room`` (32 pages) and stop half-way: the first 16 pages sent by every prefill rank."""
    decode = cluster.clients[cluster.decode[0].rank_id]
    decode.expect(room, cluster.bootstrap, list(range(32, 64)))
    wait_status(decode, room, [RoomStatus.WAITING_FOR_INPUT])
    for geometry in cluster.prefill:
        cluster.clients[geometry.rank_id].send(room, list(range(0, 16)), last_chunk=False)
    wait_status(decode, room, [RoomStatus.TRANSFERRING])


def _reattach(cluster, rank) -> None:
    """The worker of ``rank`` (alive, same pools) registers with the restarted sidecar."""
    cluster.clients[rank.rank_id].close()
    client = cluster.clients[rank.rank_id] = Client(
        cluster.sidecars[rank.rank_id].endpoint, rank.rank_id, timeout_s=20
    )
    client.register(rank, cluster.pools[rank.rank_id].handles)


def _room_lands(cluster, room: int, src, dst) -> None:
    requests = kv_requests(src, dst)
    cluster.expect(room, requests)
    cluster.send(room, requests)
    state = cluster.clients[cluster.decode[0].rank_id].wait(room, timeout_s=15)
    assert state.status is RoomStatus.SUCCESS, state.reason
    assert check_sim(cluster, SEED, requests) == []


def test_killed_prefill_rank_fails_the_room_naming_it_and_a_restart_serves_new_rooms(cluster):
    decode = cluster.clients[cluster.decode[0].rank_id]
    rank0, rank1 = cluster.prefill
    _transferring(cluster, 1)

    cluster.sidecars[rank1.rank_id].kill()
    started = time.monotonic()
    state = decode.wait(1, timeout_s=10)
    assert time.monotonic() - started < LOST_WITHIN_S
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "lost prefill peer prefill[pp0,tp1]" in state.reason
    # the surviving prefill rank was told: its half of the room ends too
    survivor = wait_status(cluster.clients[rank0.rank_id], 1, TERMINAL)
    assert survivor.status is RoomStatus.FAILED and survivor.code_text == "aborted", survivor.reason

    restart_sidecar(cluster, rank1.rank_id)
    _reattach(cluster, rank1)
    _room_lands(cluster, 2, range(40, 48), range(0, 8))


def test_killed_decode_sidecar_fails_the_prefill_rooms_and_a_restart_serves_new_rooms(cluster):
    decode = cluster.decode[0]
    _transferring(cluster, 3)

    cluster.sidecars[decode.rank_id].kill()
    started = time.monotonic()
    for geometry in cluster.prefill:
        state = cluster.clients[geometry.rank_id].wait(3, timeout_s=10)
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
        assert "lost decode peer decode[pp0,tp0]" in state.reason
        # the worker's last chunk of the dead room is answered with the failure, not a hang
        cluster.clients[geometry.rank_id].send(3, list(range(16, 32)))
    assert time.monotonic() - started < LOST_WITHIN_S

    restart_sidecar(cluster, decode.rank_id)
    _reattach(cluster, decode)
    _room_lands(cluster, 4, range(48, 56), range(8, 16))


def _decode_maps(cluster, geometry) -> Counter:
    """How often ``geometry``'s prefill sidecar maps each decode segment."""
    segments = {name for g in cluster.decode for name in cluster.pools[g.rank_id].handles.values()}
    maps = Path(f"/proc/{cluster.sidecars[geometry.rank_id].proc.pid}/maps").read_text()
    return Counter(
        line.rsplit("/", 1)[-1] for line in maps.splitlines() if line.rsplit("/", 1)[-1] in segments
    )


def test_restarts_leave_each_decode_segment_mapped_once_per_prefill_sidecar(cluster):
    decode = cluster.decode[0]
    cluster.sidecars[decode.rank_id].kill()
    # each prefill sidecar lets go of the dead sidecar's mappings once it notices the loss
    deadline = time.monotonic() + 10
    while any(_decode_maps(cluster, g) for g in cluster.prefill) and time.monotonic() < deadline:
        time.sleep(0.05)
    restart_sidecar(cluster, decode.rank_id)
    _reattach(cluster, decode)
    _room_lands(cluster, 6, range(24, 32), range(24, 32))  # prefill maps the new sidecar's segments
    for geometry in cluster.prefill:
        counts = _decode_maps(cluster, geometry)
        assert max(counts.values()) == 1, f"{geometry.rank_id} maps decode segments: {dict(counts)}"


def test_restarted_prefill_rank_0_serves_new_rooms_without_restarting_the_others(cluster):
    rank0 = cluster.prefill[0]
    cluster.sidecars[rank0.rank_id].kill()
    restart_sidecar(cluster, rank0.rank_id)
    _reattach(cluster, rank0)
    _room_lands(cluster, 5, range(56, 64), range(16, 24))
