"""A peer whose host vanishes is lost when its connection times out, not at the slow limit.

The two sidecars run as on two hosts (different ``host_id``, tcp) inside a
network namespace of the test's own (:mod:`private_network`); mid-room, its
loopback stops passing packets: no FIN, no RST, no acknowledgement, as when
the peer's host loses power. Neither sidecar can watch the other's process,
and the heartbeats alone would call the silent peer slow until
``slow_peer_limit_s`` (120 s here). The kernel's watch on the control
connections (``peer_connection_timeout_s``, 3 s here: unacknowledged data or
keepalive probes) closes them, and each side then fails the room
``peer_lost``, saying the connection closed, long before the slow limit.
"""

import pytest
from fault_tools import fill_sim, tiny_ranks, wait_status
from private_network import private_network

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

SLOW_PEER_LIMIT_S = 120.0


@pytest.fixture
def network():
    with private_network() as network:
        yield network


def test_both_sides_lose_a_peer_whose_host_vanished_by_the_connection_timeout(deployment, network):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=32),
        tiny_ranks(Role.DECODE, 1, num_pages=32),
        config={
            "heartbeat_interval_s": 0.5,
            "heartbeat_misses": 4,
            "slow_peer_limit_s": SLOW_PEER_LIMIT_S,
            "peer_connection_timeout_s": 3.0,
            "bootstrap_timeout_s": SLOW_PEER_LIMIT_S,
            "waiting_timeout_s": SLOW_PEER_LIMIT_S,
            "transfer_timeout_s": SLOW_PEER_LIMIT_S,
            "transport": "tcp",
            "host_id": "prefill-host",
        },
        decode_config={"host_id": "decode-host"},
        command_prefix=network.prefix,
    )
    fill_sim(cluster, 5)
    decode = cluster.clients[cluster.decode[0].rank_id]
    prefill = cluster.clients[cluster.prefill[0].rank_id]
    decode.expect(1, cluster.bootstrap, list(range(16, 24)))
    wait_status(decode, 1, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    prefill.send(1, list(range(0, 4)), last_chunk=False)
    wait_status(prefill, 1, [RoomStatus.TRANSFERRING], timeout_s=60)

    network.vanish()
    # far under the 120 s slow limit and every room timeout: only the connection can end it
    states = {"prefill": prefill.wait(1, timeout_s=60), "decode": decode.wait(1, timeout_s=60)}
    network.restore()  # the sidecars then stop in order at the test's end

    for side, state in states.items():
        assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", (
            side,
            state,
            cluster.logs(),
        )
    assert "lost decode peer decode[pp0,tp0]" in states["prefill"].reason, states["prefill"].reason
    assert "lost prefill peer prefill[pp0,tp0]" in states["decode"].reason, states["decode"].reason
    for state in states.values():
        assert "connection closed" in state.reason, (state.reason, cluster.logs())
