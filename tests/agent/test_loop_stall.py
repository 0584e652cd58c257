"""A sidecar that could not run for a while does not blame its peers for the silence.

While a sidecar is starved of CPU (or its loop is held by a long call), its
peers' heartbeats wait unread in the kernel's and ZeroMQ's buffers. A stall
longer than the heartbeat limit must not make the sidecar declare every peer
lost the moment it wakes, before it reads what they sent, and fail their
rooms with peer_lost. The stall counts as time it could not listen, is
logged, and is exported as pd_transfer_loop_stall_seconds_total.
"""

import os
import signal
import time

import numpy as np
from cluster import small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Pool

STALL_S = 1.6


def test_a_stalled_decode_sidecar_keeps_its_peers_and_its_rooms(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 1, 1)
    # decode loses a silent peer after 1 s, less than its stall; prefill only after 4 s,
    # so decode's own silence while it is stopped does not end the pair from that side
    cluster = cluster_factory(
        prefill, decode, config={"heartbeat_misses": 20}, decode_config={"heartbeat_misses": 5}
    )
    rng = np.random.default_rng(8)
    rank = decode[0].rank_id

    def move(i: int, room: int):
        requests = {Pool.KV: (rng.choice(6, 2, replace=False), np.array([2 * i, 2 * i + 1]))}
        cluster.expect(room, requests)
        cluster.send(room, requests)
        (state,) = cluster.wait_decode(room, timeout_s=30).values()
        assert state.status is RoomStatus.SUCCESS, (room, state, cluster.logs())
        return requests[Pool.KV]

    moved = [move(0, 40)]  # the session to prefill is open
    pid = cluster.sidecars[rank].proc.pid
    for i in (1, 2):  # twice: whether the timers or the readers run first on waking varies
        os.kill(pid, signal.SIGSTOP)  # starved: no thread of it runs
        time.sleep(STALL_S)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)  # it wakes, reads the queued heartbeats
        moved.append(move(i, 40 + i))
    assert cluster.verify({Pool.KV: tuple(np.concatenate(side) for side in zip(*moved))}) == []

    assert cluster.metric(rank, "pd_transfer_loop_stall_seconds_total") >= 2 * (STALL_S - 0.3)
    assert cluster.metric(rank, "pd_transfer_heartbeat_misses_total") == 0, cluster.logs()
    assert cluster.metric(prefill[0].rank_id, "pd_transfer_heartbeat_misses_total") == 0
    assert "event loop stalled for" in cluster.logs()
