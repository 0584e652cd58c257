"""Strangers on a ZeroMQ worker endpoint (``ipc://``) are bounded as on ``unix://``.

Against a prefill sidecar serving its worker on ``ipc://``, local connections
that complete ZeroMQ's greeting and never authenticate:

- 16 each declare a 60 MiB frame and send all but its last MiB, 16 more send
  1 MiB frames flagged "more to come" (ZeroMQ holds an unfinished message's
  frames until its last one): each is ended at the handshake deadline, the
  real workers register and a room completes while they are connected, and
  the sidecar's memory returns once they are gone;
- 64 more idle strangers than the endpoint's bound: the oldest make room and
  each is counted.

Real sidecar processes, real sockets; deadlines are upper bounds only.
"""

from __future__ import annotations

import threading

import pytest
from cluster import Cluster
from hostile_wire import MiB, connection_dropped, rss_kib, send_oversized_frame, wait_for, zmtp_connect
from secure_cluster import SECRET_HEX, metric, ranks, requests, write_secret

from pd_transfer.agent.stream_router import MAX_PENDING
from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

P0 = "prefill[pp0,tp0]"
DEADLINE_S = 4.0  # the sidecars' handshake deadline (bootstrap_timeout_s)
BOUND_KIB = 64 * 1024  # what the prefill may keep once the strangers are gone
REFUSED = "pd_transfer_connections_refused_total"


@pytest.fixture(scope="module")
def cluster(workdir):
    secret = write_secret(workdir, "secret", SECRET_HEX)
    made = Cluster(
        workdir,
        ranks(Role.PREFILL, 1),
        ranks(Role.DECODE, 1),
        attach=False,
        worker_scheme="ipc",
        config={"secret_file": str(secret), "bootstrap_timeout_s": DEADLINE_S},
    )
    made.secret = secret
    yield made
    made.close()


def _path(cluster) -> str:
    return cluster.sidecars[P0].endpoint.removeprefix("ipc://")


def _refused(cluster, reason: str) -> float:
    return metric(cluster, P0, REFUSED, socket="worker", reason=reason)


def _send_more_parts(sock, parts: int) -> None:
    """``parts`` frames of 1 MiB, each flagged MORE: one message that never ends."""
    block = b"\x03" + (MiB).to_bytes(8, "big") + b"\x00" * MiB
    try:
        for _ in range(parts):
            sock.sendall(block)
    except OSError:
        pass


def _attach(cluster) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PD_TRANSFER_SECRET_FILE", str(cluster.secret))
        cluster.attach_all()


def test_strangers_partial_frames_end_at_the_deadline_and_the_memory_returns(cluster):
    pid = cluster.sidecars[P0].proc.pid
    baseline = rss_kib(pid)
    before = _refused(cluster, "handshake_timeout")
    big = [zmtp_connect(_path(cluster)) for _ in range(16)]
    parted = [zmtp_connect(_path(cluster)) for _ in range(16)]
    pushers = [threading.Thread(target=send_oversized_frame, args=(s, 60 * MiB, 59 * MiB)) for s in big]
    pushers += [threading.Thread(target=_send_more_parts, args=(s, 16)) for s in parted]
    try:
        for thread in pushers:
            thread.start()
        _attach(cluster)  # the real workers authenticate and register among them
        for thread in pushers:
            thread.join(timeout=120)
        assert all(connection_dropped(sock, 60) for sock in big + parted), "a stranger outlived the deadline"
    finally:
        for sock in big + parted:
            sock.close()
    wait_for(lambda: _refused(cluster, "handshake_timeout") - before >= 32, 30, "the 32 cut off counted")
    wait_for(lambda: rss_kib(pid) - baseline < BOUND_KIB, 30, "the strangers' memory returned")
    cluster.expect(1, requests(1))
    cluster.send(1, requests(1))
    states = cluster.wait_decode(1, timeout_s=30)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify_landed(1, requests(1)) == []


def test_a_flood_of_idle_strangers_is_bounded_and_the_worker_still_serves(cluster):
    before = _refused(cluster, "pending_limit")
    idle = [zmtp_connect(_path(cluster)) for _ in range(MAX_PENDING + 8)]
    try:
        assert all(connection_dropped(sock, 30) for sock in idle[:8])  # the oldest made room
        wait_for(lambda: _refused(cluster, "pending_limit") - before >= 8, 30, "evictions counted")
        cluster.expect(2, requests(2))  # the registered workers' connections are not strangers
        cluster.send(2, requests(2))
        states = cluster.wait_decode(2, timeout_s=30)
        assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    finally:
        for sock in idle:
            sock.close()
