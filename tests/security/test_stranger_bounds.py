"""Strangers on the control and bootstrap ports are bounded: how many, how long, how many bytes.

A prefill sidecar limited to 1,024 file descriptors (soft and hard, as on a
default host) faces connections that never authenticate:

- 1,100 idle ZeroMQ connections (the ZMTP handshake, then nothing), half on
  the control port and half on the bootstrap port: its health port stays
  reachable, a real decode still completes a room over new connections while
  they are open, its memory stays within the bound, and every eviction is
  counted in ``pd_transfer_connections_refused_total{reason="pending_limit"}``;
- 16 connections each holding 15 MiB of a frame under the 16 MiB cap: each
  is dropped, and the memory returns;
- a burst of 8,000 connections from four processes at once: the descriptors
  it holds stay below its limit (ZeroMQ accepts no further ahead of the
  sidecar than its monitor's queue), its health port answers throughout, and
  a real decode completes a room beside them;
- 1,100 ``AuthHello`` frames, each from its own connection, arriving between a
  real peer's hello and its proof: the real handshake still completes;
- a refused handshake, and a member refused for registering under another
  name, get one answer and then nothing: the connection ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from hostile_wire import (
    MiB,
    connection_dropped,
    host_port,
    rss_kib,
    send_oversized_frame,
    wait_for,
    zmtp_connect,
    zmtp_read,
    zmtp_send,
)
from secure_cluster import SECRET_HEX, WRONG_HEX, RawPeer, metric, ranks, requests, start, write_secret

from pd_transfer.agent.descriptors import fd_reserve_for
from pd_transfer.client import RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, Hello, Register, decode, encode
from pd_transfer.security import ClientHandshake, new_routing_id, parse_secret
from pd_transfer.security.messages import AuthProof, AuthResult
from pd_transfer.security.messages import decode as decode_auth
from pd_transfer.security.messages import encode as encode_auth

P0 = "prefill[pp0,tp0]"
NOFILE = 1024  # the prefill's descriptors, soft and hard
IDLE = 1100
REFUSED = "pd_transfer_connections_refused_total"
BOUND_KIB = 64 * 1024  # the most the prefill's memory may grow with strangers connected
KEY = parse_secret(SECRET_HEX.encode(), "test")


@pytest.fixture(scope="module")
def cluster(workdir):
    secret = write_secret(workdir, "secret", SECRET_HEX)
    made = start(workdir, ranks(Role.PREFILL, 1), ranks(Role.DECODE, 1), secret, prefill_nofile=NOFILE)
    yield made
    made.close()


def _control(cluster) -> str:
    return cluster.ready[P0]["control_address"]


def _refused(cluster, reason: str) -> float:
    return sum(metric(cluster, P0, REFUSED, socket=s, reason=reason) for s in ("control", "bootstrap"))


def _idle(address):
    try:
        return zmtp_connect(address)
    except OSError:  # refused before the ZeroMQ greeting came back
        return None


def _room_lands(cluster, room: int, pages: int = 0) -> None:
    """Room ``room`` moves the pages of the oracle's room ``pages`` (``room``'s own by default)."""
    moved = requests(pages or room)
    cluster.expect(room, moved)
    cluster.send(room, moved)
    states = cluster.wait_decode(room, timeout_s=30)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify_landed(room, moved) == []


def test_1100_idle_connections_leave_health_rooms_and_memory_intact(cluster):
    pid = cluster.sidecars[P0].proc.pid
    baseline = rss_kib(pid)
    before = _refused(cluster, "pending_limit")
    addresses = [host_port(_control(cluster)), host_port(cluster.bootstrap)]
    held = []
    try:
        for i in range(IDLE):
            sock = _idle(addresses[i % 2])
            if sock is not None:
                held.append(sock)
        status, _ = cluster.http(P0, "/healthz")
        assert status == 200
        _room_lands(cluster, 1)  # the decode's first bootstrap and control connections
        assert len(os.listdir(f"/proc/{pid}/fd")) < NOFILE - 128
        assert rss_kib(pid) - baseline < BOUND_KIB
        # the sidecar kept at most its bound of them (32 a port, 64 in all) and counted the rest
        wait_for(lambda: _refused(cluster, "pending_limit") - before >= IDLE - 64, 30, "evictions counted")
    finally:
        for sock in held:
            sock.close()
    assert cluster.sidecars[P0].proc.poll() is None


def test_partial_frames_of_strangers_are_dropped_and_their_memory_returned(cluster):
    pid = cluster.sidecars[P0].proc.pid
    baseline = rss_kib(pid)
    before = _refused(cluster, "nbytes")
    socks = [zmtp_connect(host_port(_control(cluster))) for _ in range(16)]
    try:
        for sock in socks:  # each declares a frame under the 16 MiB cap and sends 15 MiB of it
            send_oversized_frame(sock, 16 * MiB - 4096, 15 * MiB)
        assert all(connection_dropped(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: _refused(cluster, "nbytes") - before >= 16, 10, "the 16 drops counted")
    wait_for(lambda: rss_kib(pid) - baseline < BOUND_KIB, 10, "the strangers' memory returned")


def test_an_auth_hello_flood_does_not_evict_a_half_done_handshake(cluster):
    real = RawPeer(_control(cluster), new_routing_id())
    handshake = ClientHandshake(KEY, "decode-real")
    proof = handshake.receive(real.ask(handshake.hello()))  # the real peer is half-way
    before = _refused(cluster, "pending_limit")
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 2 * IDLE)
    flood = []
    try:
        pid = cluster.sidecars[P0].proc.pid
        for i in range(IDLE):  # a hello each from 1,100 connections, before the real proof
            if i % 100 == 0:  # in bursts of 100 (see docs/security.md on bursts)
                wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) < NOFILE // 2, 30, "descriptors freed")
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 60_000)  # a refused one does not come back
            sock.setsockopt(zmq.ROUTING_ID, new_routing_id())
            sock.connect(_control(cluster))
            sock.send(ClientHandshake(KEY, f"flood-{i}").hello())
            flood.append(sock)
        answered: set[int] = set()

        def settled() -> bool:
            for i, sock in enumerate(flood):
                if i not in answered and sock.poll(0):
                    sock.recv()
                    answered.add(i)
            return len(answered) + _refused(cluster, "pending_limit") - before >= IDLE - 2

        wait_for(settled, 60, "every flood hello answered or its connection refused", interval_s=0.2)
        accepted = decode_auth(real.ask(proof))
        assert isinstance(accepted, AuthResult) and accepted.accepted, accepted
    finally:
        for sock in flood:
            sock.close(linger=0)
        context.term()
        real.close()
    _room_lands(cluster, 2)  # the decode's session was never among the strangers


def test_a_refused_handshake_ends_the_connection(cluster):
    sock = zmtp_connect(host_port(_control(cluster)), new_routing_id())
    try:
        wrong = ClientHandshake(parse_secret(WRONG_HEX.encode(), "test"), "decode-wrong")
        zmtp_send(sock, wrong.hello())
        (challenge,), _ = zmtp_read(sock, 2.0)
        nonce = decode_auth(challenge).nonce
        zmtp_send(sock, encode_auth(AuthProof(nonce=nonce, proof=b"\0" * 32)))
        hello = encode(Hello(agent_id="decode-wrong", role=Role.DECODE))
        for _ in range(43):  # the frames that once got a Close each
            zmtp_send(sock, hello)
        answers, closed = zmtp_read(sock, 3.0)
    finally:
        sock.close()
    refused = decode_auth(answers[0])
    assert isinstance(refused, AuthResult) and refused.reason is Reason.AUTH_FAILED
    assert answers[1:] == [] and closed


def test_a_member_refused_for_its_name_gets_one_close_and_the_connection_ends(cluster):
    sock = zmtp_connect(host_port(_control(cluster)), new_routing_id())
    try:
        handshake = ClientHandshake(KEY, "honest-name")
        zmtp_send(sock, handshake.hello())
        (challenge,), _ = zmtp_read(sock, 2.0)
        zmtp_send(sock, handshake.receive(challenge))
        (result,), _ = zmtp_read(sock, 2.0)
        assert decode_auth(result).accepted
        zmtp_send(sock, encode(Hello(agent_id="honest-name", role=Role.DECODE)))
        geometry = ranks(Role.DECODE, 1)[0]
        zmtp_send(sock, encode(Register(agent_id="someone-else", host_id="h", geometry=geometry)))
        time.sleep(0.05)
        for _ in range(43):
            zmtp_send(sock, encode(Hello(agent_id="honest-name", role=Role.DECODE)))
        answers, closed = zmtp_read(sock, 3.0)
    except OSError:  # cut off while still sending: ended, as it should be
        answers, closed = zmtp_read(sock, 1.0)
    finally:
        sock.close()
    replies = [decode(frame) for frame in answers]
    closes = [r for r in replies if isinstance(r, Close)]
    assert len(closes) == 1 and closes[0].reason is Reason.AUTH_FAILED, replies
    assert replies[-1] is closes[0] and closed, replies


_FLOOD = """
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
time.sleep(max(0.0, float(sys.argv[5]) - time.time()))  # all flooders at once
for _ in range(int(sys.argv[3])):
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.connect((sys.argv[1], int(sys.argv[2])))
    except BlockingIOError:
        pass
    held.append(sock)
time.sleep(float(sys.argv[4]))
"""


def test_a_burst_of_connections_leaves_descriptors_health_and_rooms(cluster):
    pid = cluster.sidecars[P0].proc.pid
    host, port = host_port(_control(cluster))
    peak, answers, done = [0], [], threading.Event()

    def count() -> None:  # the prefill's descriptors, all through the burst
        while not done.is_set():
            try:
                peak[0] = max(peak[0], len(os.listdir(f"/proc/{pid}/fd")))
            except OSError:
                pass

    def health() -> None:  # and its health port
        while not done.wait(0.05):
            try:
                answers.append(cluster.http(P0, "/healthz")[0])
            except OSError as err:  # unreachable: what this test rules out
                answers.append(repr(err))

    watchers = [threading.Thread(target=count), threading.Thread(target=health)]
    for watcher in watchers:
        watcher.start()
    start_at = str(time.time() + 2)
    floods = [
        subprocess.Popen([sys.executable, "-c", _FLOOD, host, str(port), "2000", "8", start_at])
        for _ in range(4)
    ]
    try:
        time.sleep(5)  # the burst, and the sidecar cutting it down
        _room_lands(cluster, 3, pages=2)  # while the flooders still hold what they opened
    finally:
        for flood in floods:
            flood.wait(timeout=60)
        done.set()
        for watcher in watchers:
            watcher.join()
    # strangers never reached the descriptors kept in reserve for peers, the worker and health
    ceiling = NOFILE - fd_reserve_for(NOFILE)
    assert peak[0] < ceiling, f"the prefill held {peak[0]} descriptors in the burst (reserve from {ceiling})"
    assert answers and set(answers) == {200}, answers
    assert cluster.sidecars[P0].proc.poll() is None
