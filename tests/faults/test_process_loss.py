"""A peer on the same host is lost when its process ends, not when its heartbeats run out.

Heartbeats here are 0.5 s with 20 misses: by heartbeats alone a dead peer
would be declared lost after 10 s, and a slow one (a sidecar starved of CPU)
is lost only after ``slow_peer_limit_s``. Each sidecar watches the process
of a peer on its host (``agent/peer_process.py``): a decode sidecar killed
with SIGKILL makes the prefill rank fail the room in flight with
``peer_lost`` at its next timer tick, saying the process ended (before its
closed connection, which counts after one interval: test_remote_peer_liveness.py).
"""

import time

import pytest
from fault_tools import fill_sim, tiny_ranks, wait_status

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

HEARTBEAT_S, MISSES = 0.5, 20
LOST_BY_HEARTBEATS_S = HEARTBEAT_S * MISSES


@pytest.fixture
def cluster(deployment):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=16),
        tiny_ranks(Role.DECODE, 1, num_pages=16),
        config={"heartbeat_interval_s": HEARTBEAT_S, "heartbeat_misses": MISSES},
    )
    fill_sim(cluster, 3)
    return cluster


def test_a_killed_decode_sidecar_is_lost_when_its_process_ends(cluster):
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    decode_client, prefill_client = cluster.clients[decode.rank_id], cluster.clients[prefill.rank_id]
    decode_client.expect(1, cluster.bootstrap, list(range(8, 16)))
    wait_status(decode_client, 1, [RoomStatus.WAITING_FOR_INPUT])
    prefill_client.send(1, list(range(0, 4)), last_chunk=False)
    wait_status(prefill_client, 1, [RoomStatus.TRANSFERRING])
    pid = cluster.sidecars[decode.rank_id].proc.pid

    cluster.sidecars[decode.rank_id].kill()
    started = time.monotonic()
    state = prefill_client.wait(1, timeout_s=LOST_BY_HEARTBEATS_S + 5)
    elapsed = time.monotonic() - started
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert f"lost decode peer decode[pp0,tp0]: its process (pid {pid} on this host) ended" in state.reason
    assert elapsed < LOST_BY_HEARTBEATS_S / 3, f"lost after {elapsed:.1f} s"
