"""A channel follows its peer's ZeroMQ connection (agent/channels.py).

An outgoing one: down when the peer's socket closes, up again when a peer
listens at the address once more. An incoming one (prefill's control ROUTER):
down when the connection its peer's frames came on ends, as the ROUTER's
monitor names it; up again when the peer reconnects under its routing id;
and down when the peer's process is stopped and cannot answer ZeroMQ's
heartbeats, though its kernel keeps the TCP connection open.
"""

import asyncio
import os
import socket
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from pd_transfer.agent.auth import DISABLED, SecureContext
from pd_transfer.agent.channels import IncomingChannels, OutgoingChannel
from pd_transfer.agent.zmq_bounds import PeerKeepalive
from pd_transfer.layout.geometry import Role
from pd_transfer.processes.ports import spare_port
from pd_transfer.protocol import Heartbeat, Hello, encode

pytestmark = pytest.mark.asyncio


async def _until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


async def _nothing(channel, message) -> None:
    return None


async def test_a_channel_is_down_while_its_peer_is_gone_and_up_when_it_is_back():
    context = zmq.asyncio.Context()
    address = f"tcp://127.0.0.1:{spare_port()}"
    peer = context.socket(zmq.ROUTER)
    peer.bind(address)
    channel = OutgoingChannel(context, address, Role.DECODE, "prefill 0")
    try:
        channel.start(_nothing)
        await asyncio.sleep(0.2)
        assert channel.disconnected_s is None
        peer.close(linger=0)  # the peer process is gone: its socket closed
        await _until(lambda: channel.disconnected_s is not None, "the channel saw it drop")
        since = channel.disconnected_s
        await asyncio.sleep(0.3)  # ZeroMQ retries in vain: still down since then
        assert channel.disconnected_s == since
        peer = context.socket(zmq.ROUTER)
        peer.bind(address)  # a peer listens there again: reconnected
        await _until(lambda: channel.disconnected_s is None, "the channel saw it come back")
    finally:
        channel.close()
        peer.close(linger=0)
        await asyncio.sleep(0)  # let the cancelled watcher close its monitor socket
        context.destroy(linger=0)


def _listening(keepalive=None, bad_frames=None):
    """A prefill's control ROUTER on a context that runs ``keepalive`` (the sidecar's)."""
    context = SecureContext(DISABLED)
    context.peer_keepalive = keepalive
    on_bad_frame = (bad_frames if bad_frames is not None else []).append
    return context, IncomingChannels(context, "127.0.0.1", 0, Role.PREFILL, on_bad_frame=on_bad_frame)


async def _session_from(router, send_hello) -> object:
    """The incoming channel whose Hello ``send_hello()`` sent."""
    heard = []

    async def on_message(channel, message) -> None:
        heard.append(channel)

    serving = asyncio.create_task(router.serve(on_message))
    send_hello()
    await _until(lambda: heard, "the peer's Hello reached its session")
    return serving, heard[0]


HELLO = encode(Hello(agent_id="decode-0", role=Role.DECODE))


async def test_an_incoming_session_is_down_once_its_peer_closed_its_connection():
    bad_frames = []
    context, router = _listening(bad_frames=bad_frames)
    peer = context.socket(zmq.DEALER)
    peer.connect(router.address)
    serving, channel = await _session_from(router, lambda: peer.send(HELLO))
    try:
        await asyncio.sleep(0.2)
        assert channel.disconnected_s is None
        peer.close(linger=0)  # the peer process is gone: its socket closed
        await _until(lambda: channel.disconnected_s is not None, "the ROUTER's monitor named its connection")
        assert router.watch.closed == 1
        assert channel.bad_frames == 0 and bad_frames == []  # its end is no frame of the peer's
    finally:
        serving.cancel()
        router.close()
        peer.close(linger=0)
        await asyncio.sleep(0)
        context.destroy(linger=0)


async def test_a_session_that_reconnects_under_its_routing_id_is_up_again():
    context, router = _listening()
    first = context.socket(zmq.DEALER)
    first.setsockopt(zmq.ROUTING_ID, b"decode-0")
    first.connect(router.address)
    serving, channel = await _session_from(router, lambda: first.send(HELLO))
    second = context.socket(zmq.DEALER)
    try:
        first.close(linger=0)
        await _until(lambda: channel.disconnected_s is not None, "its first connection is down")
        second.setsockopt(zmq.ROUTING_ID, b"decode-0")  # the same peer, back (ROUTER_HANDOVER)
        second.connect(router.address)
        await second.send(encode(Heartbeat(agent_id="decode-0", sequence=1, sent_unix_s=0.0)))
        await _until(lambda: channel.disconnected_s is None, "a frame on its new connection")
    finally:
        serving.cancel()
        router.close()
        second.close(linger=0)
        await asyncio.sleep(0)
        context.destroy(linger=0)


def _watch_of(fd: int) -> tuple[int, int, int]:
    """(SO_KEEPALIVE, TCP_KEEPIDLE, TCP_USER_TIMEOUT) of the connection on ``fd``."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        )
    finally:
        sock.close()


def _connections_to(port: int) -> list[int]:
    """This process's descriptors of TCP connections to or from ``port``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            ends = (sock.getsockname(), sock.getpeername())
            if sock.family == socket.AF_INET and port in (ends[0][1], ends[1][1]):
                found.append(int(name))
        except OSError:  # not a socket, or not connected
            pass
        finally:
            sock.close()
    return found


async def test_the_kernel_watches_both_ends_of_a_control_connection():
    # a host that vanishes sends no FIN: keepalive probes (after 1 s idle) and the user
    # timeout close the connection within the timeout, on the listening and connecting side
    context, router = _listening(PeerKeepalive(timeout_s=7.0))
    channel = OutgoingChannel(context, router.address, Role.DECODE, "prefill 0")
    serving = None
    try:
        channel.start(_nothing)
        hello = Hello(agent_id="decode-0", role=Role.DECODE)
        serving, incoming = await _session_from(router, lambda: asyncio.ensure_future(channel.send(hello)))
        await _until(lambda: channel.watched, "the outgoing connection is up")
        assert incoming.watched
        port = int(router.address.rsplit(":", 1)[1])
        ends = _connections_to(port)
        assert len(ends) == 2, ends  # the ROUTER's accepted end, the DEALER's connected end
        assert [_watch_of(fd) for fd in ends] == [(1, 1, 7000)] * 2
    finally:
        if serving is not None:
            serving.cancel()
        channel.close()
        router.close()
        await asyncio.sleep(0)
        context.destroy(linger=0)


async def test_an_outgoing_channel_is_down_until_a_zeromq_handshake_completes():
    # the peer's socket closed, and something that is not its ZeroMQ (a stopped process's
    # backlog, a stranger) accepts the reconnects at the TCP level: still down
    context = SecureContext(DISABLED)
    context.peer_keepalive = PeerKeepalive(timeout_s=10.0)
    address = f"tcp://127.0.0.1:{spare_port()}"
    peer = context.socket(zmq.ROUTER)
    peer.bind(address)
    channel = OutgoingChannel(context, address, Role.DECODE, "prefill 0")
    mute = socket.socket()
    try:
        channel.start(_nothing)
        await _until(lambda: channel.watched, "the handshake completed")
        assert channel.disconnected_s is None
        peer.close(linger=0)
        await _until(lambda: channel.disconnected_s is not None, "the channel saw it drop")
        since = channel.disconnected_s
        mute.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        mute.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
        mute.listen(16)  # the kernel completes TCP connects; nobody speaks ZeroMQ
        await asyncio.sleep(1.0)  # ZeroMQ reconnects (100 ms apart): TCP connects, no handshake
        assert channel.disconnected_s == since
    finally:
        mute.close()
        channel.close()
        peer.close(linger=0)
        await asyncio.sleep(0)
        context.destroy(linger=0)


_TWO_PEERS = """
import sys, time, zmq
context = zmq.Context()
first = context.socket(zmq.DEALER)
first.connect(sys.argv[1])
first.send(bytes.fromhex(sys.argv[2]))
sys.stdin.readline()
first.close(linger=0)
time.sleep(0.5)
second = context.socket(zmq.DEALER)
second.connect(sys.argv[1])
second.send(bytes.fromhex(sys.argv[3]))
time.sleep(0.5)
print("sent", flush=True)
time.sleep(600)
"""


async def test_a_new_peer_on_the_descriptor_of_one_that_left_is_not_taken_for_it():
    # the first peer leaves and a second connects, on the descriptor the first had, while
    # this loop is blocked: the ROUTER then finds the second's Hello and the first's
    # disconnect both waiting; the disconnect is still the first's alone
    context, router = _listening()
    second_hello = encode(Hello(agent_id="decode-1", role=Role.DECODE))
    peers = subprocess.Popen(
        [sys.executable, "-c", _TWO_PEERS, router.address, HELLO.hex(), second_hello.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        serving, gone = await _session_from(router, lambda: None)
        heard_before = set(router.channels)
        peers.stdin.write(b"go\n")
        peers.stdin.flush()
        assert peers.stdout.readline() == b"sent\n"  # (blocking: this loop reads nothing meanwhile)
        await _until(lambda: set(router.channels) - heard_before, "the second peer's session")
        (new,) = [router.channels[i] for i in set(router.channels) - heard_before]
        assert new.fd == gone.fd  # the descriptor was reused: what this test is about
        await _until(lambda: gone.disconnected_s is not None, "the first peer's connection is down")
        await asyncio.sleep(0.3)
        assert new.disconnected_s is None
        serving.cancel()
    finally:
        peers.kill()
        peers.wait()
        router.close()
        await asyncio.sleep(0)
        context.destroy(linger=0)
