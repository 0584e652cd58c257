"""A peer on another host is lost when its connection ends, and only slow while it is up.

The two sidecars run as on two hosts (different ``host_id``, tcp): neither can
watch the other's process, so the prefill sidecar, which listens on one ROUTER
for its decode peers, has only the connection and the heartbeats to go by.

- A decode sidecar killed with SIGKILL closes its connection: the prefill's
  room waiting for its worker fails with ``peer_lost`` saying the connection
  closed, with heartbeats that alone would take 10 s (0.5 s x 20).
- A decode sidecar stopped (SIGSTOP) for three heartbeat limits keeps its
  connection (its kernel answers for it): it is slow, not gone, and the room
  expected before the stop lands once it runs again; no peer is lost.
- Stopped for longer than ``slow_peer_limit_s`` (4 s here), it is lost then,
  and the reason says its connection was up; on either side.
"""

import os
import signal
import time

from fault_tools import check_sim, fill_sim, kv_requests, tiny_ranks, wait_status

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

SEED = 31
SLOW_PEER_LIMIT_S = 30.0


def _two_hosts(deployment, heartbeat_s: float, misses: int, slow_peer_limit_s: float = SLOW_PEER_LIMIT_S):
    config = {
        "heartbeat_interval_s": heartbeat_s,
        "heartbeat_misses": misses,
        "slow_peer_limit_s": slow_peer_limit_s,
        "transport": "tcp",
        "host_id": "prefill-host",
    }
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=32),
        tiny_ranks(Role.DECODE, 1, num_pages=32),
        config=config,
        decode_config={"host_id": "decode-host"},
    )
    fill_sim(cluster, SEED)
    return cluster


def _transferring(cluster, room: int):
    decode = cluster.clients[cluster.decode[0].rank_id]
    prefill = cluster.clients[cluster.prefill[0].rank_id]
    decode.expect(room, cluster.bootstrap, list(range(16, 24)))
    wait_status(decode, room, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    prefill.send(room, list(range(0, 4)), last_chunk=False)
    wait_status(prefill, room, [RoomStatus.TRANSFERRING], timeout_s=60)
    return prefill


def test_a_killed_remote_decode_sidecar_is_lost_when_its_connection_closes(deployment):
    cluster = _two_hosts(deployment, heartbeat_s=0.5, misses=20)
    decode = cluster.clients[cluster.decode[0].rank_id]
    prefill = cluster.clients[cluster.prefill[0].rank_id]
    decode.expect(1, cluster.bootstrap, list(range(16, 24)))
    # the prefill holds the room, no bytes in flight: no data connection can fail it first
    wait_status(prefill, 1, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    cluster.sidecars[cluster.decode[0].rank_id].kill()
    state = prefill.wait(1, timeout_s=60)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "lost decode peer decode[pp0,tp0]" in state.reason, state.reason
    assert "its connection closed" in state.reason, state.reason
    prefill_rank = cluster.prefill[0].rank_id  # the connection's end is no bad frame
    assert cluster.metric(prefill_rank, "pd_transfer_bad_frames_total") == 0, cluster.logs()
    assert cluster.metric(prefill_rank, "pd_transfer_connections_closed_total", socket="control") >= 1


def test_a_stopped_remote_decode_sidecar_whose_connection_is_up_is_slow_not_lost(deployment):
    cluster = _two_hosts(deployment, heartbeat_s=0.2, misses=5)
    requests = kv_requests(range(0, 4), range(8, 12))
    cluster.expect(1, requests)
    decode = cluster.clients[cluster.decode[0].rank_id]
    wait_status(decode, 1, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    proc = cluster.sidecars[cluster.decode[0].rank_id].proc
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3.0)  # 3 x the 1 s heartbeat limit, far under the slow limit
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    cluster.send(1, requests)
    for state in cluster.wait_decode(1, timeout_s=60).values():
        assert state.status is RoomStatus.SUCCESS, (state.reason, cluster.logs())
    assert check_sim(cluster, SEED, requests) == []
    prefill = cluster.prefill[0].rank_id
    assert cluster.metric(prefill, "pd_transfer_heartbeat_misses_total") == 0, cluster.logs()


def test_a_stopped_remote_decode_sidecar_is_lost_at_the_slow_limit(deployment):
    cluster = _two_hosts(deployment, heartbeat_s=0.2, misses=5, slow_peer_limit_s=4.0)
    prefill = _transferring(cluster, 1)
    proc = cluster.sidecars[cluster.decode[0].rank_id].proc
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        state = prefill.wait(1, timeout_s=60)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "lost decode peer decode[pp0,tp0]: no heartbeat for" in state.reason, state.reason
    assert "though its connection is up" in state.reason, state.reason


def test_a_stopped_remote_prefill_sidecar_is_lost_at_the_slow_limit(deployment):
    cluster = _two_hosts(deployment, heartbeat_s=0.2, misses=5, slow_peer_limit_s=4.0)
    decode = cluster.clients[cluster.decode[0].rank_id]
    decode.expect(1, cluster.bootstrap, list(range(16, 24)))
    wait_status(decode, 1, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    proc = cluster.sidecars[cluster.prefill[0].rank_id].proc
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        state = decode.wait(1, timeout_s=60)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "lost prefill peer prefill[pp0,tp0]" in state.reason, state.reason
    assert "though its connection is up" in state.reason, state.reason
