"""What ``pd_transfer_peers`` tells an operator, with real sidecars: a peer whose worker
exits cleanly has *left* (nothing pages), a peer killed mid-room is *lost* (the critical
alert's input), and a lost peer that comes back clears it, so the alert resolves.

What an operator met: a decode worker that exited normally with every room done left
``pd_transfer_peers{state="lost"}`` at 1 on its sidecar for good, and PdTransferPeerLost
fired for 20 minutes.
"""

import json
import time

import numpy as np
from cluster import Cluster, random_requests, small_instances

from pd_transfer.client import RoomStatus
from pd_transfer.layout.views import Layout


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


def _peers(cluster: Cluster, rank: str, state: str) -> float:
    return cluster.metric(rank, "pd_transfer_peers", state=state)


def _a_room(prefill: Cluster, decode: Cluster, room: int, requests: dict) -> RoomStatus:
    decode.bootstrap = prefill.bootstrap
    decode.expect(room, requests)
    prefill.send(room, requests)
    return next(iter(decode.wait_decode(room).values())).status


def test_a_clean_exit_is_left_a_kill_is_lost_and_a_return_clears_it(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 1, 1, Layout.NHD)
    requests = random_requests(prefill, decode, np.random.default_rng(11), pages=2)
    cluster = cluster_factory(prefill, decode)
    p, d = prefill[0].rank_id, decode[0].rank_id
    assert _a_room(cluster, cluster, 1, requests) is RoomStatus.SUCCESS, cluster.logs()
    # both sides name the transport prefill writes with
    for rank in (p, d):
        (record,) = json.loads(cluster.http(rank, "/status")[1])["peers"]
        assert (record["state"], record["transport"]) == ("accepted", "shm"), (rank, record)

    # the decode worker exits after its room: both sides count the other as left, not lost
    cluster.clients[d].close()
    _until(lambda: _peers(cluster, p, "left") == 1, 30, "prefill counts the decode peer as left")
    _until(lambda: _peers(cluster, d, "left") == 1, 30, "decode counts the prefill peer as left")
    assert _peers(cluster, p, "lost") == 0 and _peers(cluster, d, "lost") == 0
    (record,) = json.loads(cluster.http(d, "/status")[1])["peers"]
    assert record["state"] == "left" and "the decode worker is gone" in record["reason"], record

    # a new decode of the same rank is accepted; killed mid-room, it is lost
    second = cluster_factory([], decode)
    assert _a_room(cluster, second, 2, requests) is RoomStatus.SUCCESS, cluster.logs() + second.logs()
    assert _peers(cluster, p, "accepted") == 1 and _peers(cluster, p, "left") == 0
    second.expect(3, requests)
    _until(
        lambda: (
            _peers(cluster, p, "accepted") == 1
            and cluster.metric(p, "pd_transfer_rooms", state="waiting_for_input")
        ),
        30,
        "the room waits for prefill's input",
    )
    second.sidecars[d].kill()
    _until(lambda: _peers(cluster, p, "lost") == 1, 30, "prefill counts the killed decode as lost")
    failed = cluster.clients[p].wait(3, 30)
    assert failed.status is RoomStatus.FAILED, failed

    # it comes back: the lost record goes, so PdTransferPeerLost resolves
    third = cluster_factory([], decode)
    assert _a_room(cluster, third, 4, requests) is RoomStatus.SUCCESS, cluster.logs() + third.logs()
    assert _peers(cluster, p, "lost") == 0 and _peers(cluster, p, "accepted") == 1
