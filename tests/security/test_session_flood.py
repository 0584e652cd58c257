"""A peer holding the secret floods prefill's control port with frames just under the limit.

Every frame is at most the protocol's 16 MiB, so ZeroMQ lets each through;
what bounds the sidecar's memory is how many of them ZeroMQ may queue for one
connection before the sidecar reads them (``RCVHWM``: without it, 1,000
frames, 15 GiB), and how soon a refused frame is freed (a refusal kept
with its traceback would hold the frame until the garbage collector runs).
The peer authenticates, then sends 96 frames of 15 MiB of garbage as fast as
loopback takes them: the sidecar's peak memory grows by less than the bound
below, every frame is refused and counted, and a real room still lands.
"""

from __future__ import annotations

import time

import pytest
import zmq
from hostile_wire import MiB, rss_kib
from secure_cluster import SECRET_HEX, metric, ranks, requests, start, write_secret

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.security import ClientHandshake, new_routing_id, parse_secret
from pd_transfer.security.messages import decode as decode_auth

FRAMES = 96
FRAME_NBYTES = 15 * MiB
# the most the sidecar's peak RSS may grow meanwhile: 16 frames' worth, a sixth of the flood.
# ZeroMQ holds 4 queued (RCVHWM) and 1 being read, the kernel a socket buffer, Python the one
# it refuses, and the allocator keeps some of the freed ones (about 100-180 MiB measured,
# the high end with the CPUs busy); every frame held would be 1,440 MiB
BOUND_KIB = 16 * FRAME_NBYTES // 1024
P0 = "prefill[pp0,tp0]"


@pytest.fixture(scope="module")
def cluster(workdir):
    secret = write_secret(workdir, "secret", SECRET_HEX)
    made = start(workdir, ranks(Role.PREFILL, 1), ranks(Role.DECODE, 1), secret)
    yield made
    made.close()


def test_frames_under_the_limit_from_an_authenticated_peer_are_not_all_held(cluster):
    pid = cluster.sidecars[P0].proc.pid
    baseline = max(rss_kib(pid), rss_kib(pid, "VmHWM"))
    before = metric(cluster, P0, "pd_transfer_bad_frames_total")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
    sock.setsockopt(zmq.SNDHWM, 0)  # the flooder queues everything it sends
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(cluster.ready[P0]["control_address"])
    try:
        handshake = ClientHandshake(parse_secret(SECRET_HEX.encode(), "test"), "decode-flood")
        sock.send(handshake.hello())
        sock.send(handshake.receive(sock.recv()))
        assert decode_auth(sock.recv()).accepted
        garbage = b"\xc1" * FRAME_NBYTES  # 0xc1: never valid msgpack
        started = time.monotonic()
        for _ in range(FRAMES):
            sock.send(garbage, copy=False)
        peak = baseline
        while time.monotonic() - started < 60:  # while the sidecar works through them
            peak = max(peak, rss_kib(pid, "VmHWM"))
            if metric(cluster, P0, "pd_transfer_bad_frames_total") - before >= FRAMES:
                break
            time.sleep(0.1)
        peak = max(peak, rss_kib(pid, "VmHWM"))
    finally:
        sock.close()
        context.term()
    assert peak - baseline < BOUND_KIB, (
        f"peak RSS grew by {(peak - baseline) // 1024} MiB for {FRAMES} frames of 15 MiB"
    )
    assert metric(cluster, P0, "pd_transfer_bad_frames_total") - before == FRAMES, (
        "every frame refused and counted"
    )
    assert cluster.sidecars[P0].proc.poll() is None
    cluster.expect(1, requests(1))
    cluster.send(1, requests(1))
    states = cluster.wait_decode(1, timeout_s=20)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests(1)) == []
