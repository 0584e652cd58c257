"""A prefill sidecar that dies is lost when its connection closes, not when its heartbeats run out.

Heartbeats here are 0.5 s with 20 misses: by heartbeats alone a dead peer
would be declared lost after 10 s. The decode sidecar watches its ZeroMQ
connection to each prefill rank; a killed process closes its sockets at once,
so the room in flight must fail with ``peer_lost`` after about one interval,
with a reason that says the connection closed. A room expected while the
connection is down, before the loss is declared, is not sent into the dead
session: it waits for the outcome, resolves the instance again, and lands
once a restarted prefill sidecar serves it (bytes checked against the sim's
content).
"""

import time

import pytest
from fault_tools import check_sim, fill_sim, kv_requests, restart_sidecar, tiny_ranks, wait_status

from pd_transfer.client import Client, RoomStatus
from pd_transfer.layout.geometry import Role

NUM_PAGES = 32
SEED = 5
HEARTBEAT_S, MISSES = 0.5, 20
LOST_BY_HEARTBEATS_S = HEARTBEAT_S * MISSES


@pytest.fixture(scope="module")
def cluster(module_deployment):
    cluster = module_deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 1, num_pages=NUM_PAGES),
        # as on two hosts (tcp): the connection shows the death, not the process probe
        # that watches a peer on the same host (test_process_loss.py)
        config={
            "heartbeat_interval_s": HEARTBEAT_S,
            "heartbeat_misses": MISSES,
            "bootstrap_timeout_s": 10.0,
            "transport": "tcp",
            "host_id": "prefill-host",
        },
        decode_config={"host_id": "decode-host"},
    )
    fill_sim(cluster, SEED)
    return cluster


def test_a_killed_prefill_sidecar_fails_the_room_when_its_connection_closes(cluster):
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    decode_client = cluster.clients[decode.rank_id]
    decode_client.expect(1, cluster.bootstrap, list(range(16, 32)))
    wait_status(decode_client, 1, [RoomStatus.WAITING_FOR_INPUT])
    cluster.clients[prefill.rank_id].send(1, list(range(0, 8)), last_chunk=False)
    wait_status(decode_client, 1, [RoomStatus.TRANSFERRING])

    cluster.sidecars[prefill.rank_id].kill()
    started = time.monotonic()
    time.sleep(0.05)  # the closed connection reaches decode in about a millisecond
    requests = kv_requests(range(8, 16), range(0, 8))
    cluster.expect(2, requests)  # the peer is down, not yet declared lost
    state = decode_client.wait(1, timeout_s=LOST_BY_HEARTBEATS_S + 5)
    elapsed = time.monotonic() - started
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "lost prefill peer prefill[pp0,tp0]" in state.reason
    assert "connection closed" in state.reason, state.reason
    # one heartbeat interval of grace plus a timer tick, far from the 10 s of the heartbeats
    assert elapsed < LOST_BY_HEARTBEATS_S / 3, f"lost after {elapsed:.1f} s"

    restart_sidecar(cluster, prefill.rank_id)
    cluster.clients[prefill.rank_id].close()
    client = cluster.clients[prefill.rank_id] = Client(
        cluster.sidecars[prefill.rank_id].endpoint, prefill.rank_id, timeout_s=20
    )
    client.register(prefill, cluster.pools[prefill.rank_id].handles)
    cluster.send(2, requests)
    state = decode_client.wait(2, timeout_s=15)
    assert state.status is RoomStatus.SUCCESS, state.reason
    assert check_sim(cluster, SEED, requests) == []
