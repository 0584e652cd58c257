"""A small same-host room is copied and rung before the worker's send() returns: a
reply sent first would wake the worker mid-room (about 0.3 ms of a 1-page room on
two vCPUs)."""

import time

import numpy as np
from cluster import poll_known, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Pool


def test_a_one_page_room_has_landed_when_send_returns(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 1, 1)  # a page: 2 MiB in 64 runs
    cluster = cluster_factory(prefill, decode)
    sender = cluster.clients[prefill[0].rank_id]
    receiver = cluster.clients[decode[0].rank_id]
    for room in range(20):
        requests = {
            Pool.KV: (np.array([room % 6]), np.array([(room * 5) % 6])),
            Pool.AUX: (np.array([0]), np.array([1])),
        }
        cluster.expect(room, requests)
        _wait_for_input(sender, room)  # decode's request reached prefill: send, then look
        cluster.send(room, requests)
        state = receiver.wait(room, 0)  # no waiting: the doorbell has rung, or not
        assert state.status is RoomStatus.SUCCESS, (room, state)
        if room == 0:  # the oracle knows one room's pages (later rooms rewrite them)
            assert cluster.verify(requests) == []


def _wait_for_input(client, room: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = poll_known(client, room)
        if state is not None and state.status is RoomStatus.WAITING_FOR_INPUT:
            return
        time.sleep(0.005)
    raise AssertionError(f"room {room} never waited for input at prefill")
