"""The worker side of a sidecar: hostile registrations, and a worker process that dies.

Prefill TP 1 / decode TP 1 deployments whose sidecars start with no worker
registered. On one of its own, hostile registrations are refused (each with its
reason code and the field at fault) while the sidecars keep serving. On the
module's deployment the prefill worker, a child process, registers, starts a
room and is SIGKILLed (the ``worker_died`` fixture, whichever test asks
first), and the room fails on both sides at once with ``worker_lost``;
afterwards the worker registers again and a room moves byte-exact through the
same sidecars (tests/faults/test_worker_loss.py has the rest of that story).
"""

import dataclasses

import pytest
from cluster import worker_environ
from fault_tools import kill, kv_requests, start_child_worker, tiny_ranks, wait_status

from pd_transfer.client import Client, Refused, RoomStatus, allocate_pools
from pd_transfer.client.calls import register_request, send_request
from pd_transfer.layout.geometry import Region, Role

NUM_PAGES = 64
TRANSFER_TIMEOUT_S = 1.0


def _deploy(make):
    # prefill gives up on a stalled transfer first (1 s), so decode hears prefill's
    # reason before its own 3 s pass; insecure, since the child worker is raw frames (no handshake)
    return make(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 1, num_pages=NUM_PAGES),
        attach=False,
        config={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "allow_insecure": True},
        decode_config={"transfer_timeout_s": 3.0},
    )


@pytest.fixture(scope="module")
def cluster(module_deployment):
    return _deploy(module_deployment)


@pytest.fixture
def fresh(deployment):
    """A deployment of the test's own: no worker has registered with it yet."""
    return _deploy(deployment)


def _refusal(client, request) -> Refused:
    with pytest.raises(Refused) as err:
        client._call(request)
    return err.value


def test_hostile_registrations_are_refused_with_the_field_and_the_sidecar_serves_on(fresh):
    cluster = fresh
    rank, prefill = cluster.decode[0], cluster.prefill[0]
    scratch = allocate_pools(rank, f"t{cluster._tag}-hostile")
    with worker_environ(cluster.insecure):
        client = Client(cluster.sidecars[rank.rank_id].endpoint, "hostile")
    try:
        shared = dict(scratch.handles)
        shared[rank.regions[1].id] = shared[rank.regions[0].id]
        err = _refusal(client, register_request(rank, shared, "hostile"))
        assert err.code_text == "region_invalid" and f"handles[{rank.regions[1].id!r}]" in err.reason
        assert "overlap" in err.reason

        huge = (Region(rank.regions[0].id, 2**47),) + rank.regions[1:]
        err = _refusal(
            client, register_request(dataclasses.replace(rank, regions=huge), scratch.handles, "hostile")
        )
        assert err.code_text == "limit_exceeded" and "regions[0].nbytes" in err.reason

        short = tuple(Region(r.id, r.nbytes - 1) if r.id == rank.views[0].region else r for r in rank.regions)
        err = _refusal(
            client, register_request(dataclasses.replace(rank, regions=short), scratch.handles, "hostile")
        )
        assert err.code_text == "view_out_of_region" and rank.views[0].path in err.reason

        request = register_request(rank, scratch.handles, "hostile")
        request["geometry"]["regions"][0]["nbytes"] = 0
        err = _refusal(client, request)
        assert err.code_text == "bad_field" and "regions[0].nbytes" in err.reason

        request = register_request(rank, scratch.handles, "hostile")
        request["geometry"]["views"] = request["geometry"]["views"] * (8192 // len(rank.views) + 1)
        err = _refusal(client, request)
        assert err.code_text == "limit_exceeded" and "views" in err.reason

        request = register_request(rank, scratch.handles, "hostile")
        request["handles"]["stranger"] = "pdt-stranger"
        err = _refusal(client, request)
        assert err.code_text == "unknown_region" and "handles['stranger']" in err.reason

        with worker_environ(cluster.insecure):
            to_prefill = Client(cluster.sidecars[prefill.rank_id].endpoint, "hostile")
        with to_prefill:
            err = _refusal(to_prefill, register_request(rank, scratch.handles, "hostile"))
            assert err.code_text == "role_mismatch"
    finally:
        client.close()
        scratch.close()
    # nothing of that stuck: the real decode worker registers
    cluster._attach(rank, cluster._tag)
    assert cluster.http(rank.rank_id, "/healthz")[0] == 200


@pytest.fixture(scope="module")
def worker_died(cluster):
    """The prefill worker, a child process, SIGKILLed mid-room; its next process registers.

    Returns decode's and the new prefill worker's view of that room (1)."""
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    if decode.rank_id not in cluster.clients:
        cluster._attach(decode, cluster._tag)
    # the prefill worker is a child process; its pools belong to this test (nothing leaks)
    pools = cluster.pools[prefill.rank_id] = allocate_pools(prefill, f"t{cluster._tag}-prefill")
    for region_id, array in pools.arrays.items():
        array[:] = cluster.world.prefill_buffers[prefill.rank_id][region_id]
    endpoint = cluster.sidecars[prefill.rank_id].endpoint
    cluster.clients[decode.rank_id].expect(1, cluster.bootstrap, list(range(32, 64)))
    child = start_child_worker(
        endpoint,
        [
            register_request(prefill, pools.handles, "child-worker"),
            send_request(1, list(range(0, 16)), last_chunk=False),
        ],
        cluster.workdir,
    )
    try:
        wait_status(cluster.clients[decode.rank_id], 1, [RoomStatus.TRANSFERRING])
    finally:
        kill(child)
    decode_state = cluster.clients[decode.rank_id].wait(1, timeout_s=10)
    # the worker's next process registers again, and sees the dead one's room
    with worker_environ(cluster.insecure):
        cluster.clients[prefill.rank_id] = Client(endpoint, "after-the-worker", timeout_s=20)
    cluster.clients[prefill.rank_id].register(prefill, pools.handles)
    return decode_state, wait_status(cluster.clients[prefill.rank_id], 1, [RoomStatus.FAILED])


def test_killed_prefill_worker_fails_its_room_on_both_sides_at_once(worker_died):
    state, prefill_state = worker_died
    assert state.status is RoomStatus.FAILED and state.code_text == "worker_lost", state.reason
    assert "prefill[pp0,tp0]: room 1: the prefill worker is gone (worker child-worker is gone" in state.reason
    state = prefill_state
    assert state.code_text == "worker_lost" and "the prefill worker is gone" in state.reason


def test_after_the_worker_died_the_sidecars_still_move_a_room_byte_exact(cluster, worker_died):
    # the restarted worker's registration: the decode peer resolves it anew (a new verdict)
    second = kv_requests(range(20, 28), range(0, 8))
    cluster.expect(2, second)
    cluster.send(2, second)
    assert cluster.wait_decode(2)[cluster.decode[0].rank_id].status is RoomStatus.SUCCESS
    # room 2 byte-exact; of room 1 exactly its first chunk landed, nothing else anywhere
    landed = kv_requests(list(range(0, 16)) + list(range(20, 28)), list(range(32, 48)) + list(range(0, 8)))
    assert cluster.verify(landed) == []
