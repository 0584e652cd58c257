"""Strangers on a decode sidecar's tcp data port: bounded, cut off at one deadline, counted.

A real prefill / decode pair with a shared secret and transport tcp; the test
opens raw sockets to the decode sidecar's data port. Before a connection has
authenticated, its first frame may declare at most a handshake frame's header
(4 KiB): one declaring 8 MiB is refused by its prefix, before a byte of it is
held. The whole handshake has one deadline (``data_handshake_timeout_s``, set
to 2 s here through the environment), however slowly its bytes trickle in.
Connections still in their handshake are capped (64) apart from authenticated
ones, the oldest making room for a new one, so a flood of idle strangers does
not keep a real prefill out. Every refusal is logged and counted in
``pd_transfer_bad_frames_total{reason}`` (scraped over HTTP).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from cluster import Cluster
from hostile_wire import MiB, connection_dropped, host_port, rss_kib, wait_for
from secure_cluster import SECRET_HEX, metric, ranks, requests, security, write_secret

from pd_transfer.agent.tcp_plane import DataAuth
from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.processes.ports import spare_port
from pd_transfer.transport.tcp.sockets import FrameChannel, Kind, prefix

DECODE = "decode[pp0,tp0]"
BAD_FRAMES = "pd_transfer_bad_frames_total"
DEADLINE_S = 2.0
FLOOD = 1100  # more than the 1024 connections a receiver serves at most


def _cluster(workdir: Path, environ: dict[str, str]) -> tuple[Cluster, str]:
    """Prefill TP 1 and decode TP 1 over tcp with a secret; the decode's data address."""
    secret = write_secret(workdir, f"secret-{time.monotonic_ns()}", SECRET_HEX)
    port = spare_port()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        cluster = Cluster(
            workdir,
            ranks(Role.PREFILL, 1),
            ranks(Role.DECODE, 1),
            attach=False,
            transport="tcp",
            config={"secret_file": str(secret)},
            decode_config={"data_port": port},
        )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PD_TRANSFER_SECRET_FILE", str(secret))
            cluster.attach_all()
    except BaseException:
        cluster.close()
        raise
    return cluster, f"tcp://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def workdir():
    path = Path(tempfile.mkdtemp(prefix="pdt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def deployment(workdir):
    cluster, address = _cluster(workdir, {"PD_TRANSFER_DATA_HANDSHAKE_TIMEOUT_S": str(DEADLINE_S)})
    yield cluster, address
    cluster.close()


def _room_lands(cluster: Cluster, room: int) -> None:
    wanted = requests(room)
    cluster.expect(room, wanted)
    cluster.send(room, wanted)
    states = cluster.wait_decode(room, timeout_s=30)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify_landed(room, wanted) == []


def test_garbage_and_a_wrong_magic_are_logged_counted_and_dropped(deployment):
    cluster, address = deployment
    before = metric(cluster, DECODE, BAD_FRAMES, reason="bad_frame")
    closed = metric(cluster, DECODE, "pd_transfer_connections_closed_total", socket="data")
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"XXXX" + prefix(Kind.HANDSHAKE, 16)[4:]):
        with socket.create_connection(host_port(address), timeout=5) as sock:
            sock.sendall(junk)
            assert connection_dropped(sock)
    wait_for(
        lambda: metric(cluster, DECODE, BAD_FRAMES, reason="bad_frame") - before == 2,
        5,
        "both streams counted as bad frames",
    )
    wait_for(
        lambda: metric(cluster, DECODE, "pd_transfer_connections_closed_total", socket="data") - closed == 2,
        5,
        "both ended connections counted",
    )
    assert "not a pd-transfer data stream" in cluster.sidecars[DECODE].log.read_text()


@pytest.mark.parametrize("kind", [Kind.HANDSHAKE, Kind.DATA])
def test_a_first_frame_declaring_8_mib_of_header_is_refused_before_it_is_held(deployment, kind):
    """32 strangers each declare an 8 MiB header and send all of it but a byte."""
    cluster, address = deployment
    pid = cluster.sidecars[DECODE].proc.pid
    reason = "frame_too_large" if kind is Kind.HANDSHAKE else "unauthenticated"
    before = metric(cluster, DECODE, BAD_FRAMES, reason=reason)
    baseline = max(rss_kib(pid), rss_kib(pid, "VmHWM"))
    socks, sent = [], 0
    try:
        for _ in range(32):
            sock = socket.create_connection(host_port(address), timeout=5)
            socks.append(sock)
            sock.sendall(prefix(kind, 8 * MiB))
            body = memoryview(b"\x00" * (8 * MiB - 1))
            try:
                while body:
                    k = sock.send(body[:MiB])
                    sent, body = sent + k, body[k:]
            except OSError:
                pass
        peak = rss_kib(pid, "VmHWM")
        assert all(connection_dropped(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    assert peak - baseline < 32 * 1024, (
        f"peak RSS grew by {(peak - baseline) // 1024} MiB while {sent // MiB} MiB were sent"
    )
    wait_for(
        lambda: metric(cluster, DECODE, BAD_FRAMES, reason=reason) - before == 32,
        5,
        f"32 refusals counted as {reason}",
    )


def test_an_authenticated_frame_declaring_8_gib_is_refused_by_its_prefix(deployment):
    """A peer holding the secret declares an 8 GiB chunk and streams 160 MiB of it."""
    cluster, address = deployment
    pid = cluster.sidecars[DECODE].proc.pid
    before = metric(cluster, DECODE, BAD_FRAMES, reason="frame_too_large")
    baseline = max(rss_kib(pid), rss_kib(pid, "VmHWM"))
    sock = socket.create_connection(host_port(address), timeout=5)
    try:
        DataAuth(security(SECRET_HEX, "prefill-rogue")).client(FrameChannel(sock), "decode")
        sock.sendall(prefix(Kind.DATA, 64, 8 << 30) + b"\x00" * 64)
        sent = _stream(sock, 160 * MiB)
        dropped = connection_dropped(sock)
    finally:
        sock.close()
    peak = rss_kib(pid, "VmHWM")
    assert dropped and sent < 160 * MiB, f"the receiver took {sent // MiB} MiB"
    assert peak - baseline < 32 * 1024, f"peak RSS grew by {(peak - baseline) // 1024} MiB"
    wait_for(
        lambda: metric(cluster, DECODE, BAD_FRAMES, reason="frame_too_large") - before == 1,
        5,
        "the oversized frame counted",
    )


def _stream(sock: socket.socket, nbytes: int) -> int:
    """Send up to ``nbytes`` zeros; how many the peer took before it dropped the connection."""
    piece, sent = b"\x00" * MiB, 0
    try:
        while sent < nbytes:
            sent += sock.send(piece)
    except OSError:
        pass
    return sent


def test_a_handshake_trickling_in_is_cut_off_at_its_deadline(deployment):
    """One byte every 0.4 s: never idle long, but the handshake's deadline is 2 s."""
    cluster, address = deployment
    before = metric(cluster, DECODE, BAD_FRAMES, reason="timeout")
    hello = prefix(Kind.HANDSHAKE, 100) + b"\x00" * 100
    sock = socket.create_connection(host_port(address), timeout=5)
    started, dropped_s = time.monotonic(), None
    try:
        for byte in hello:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                dropped_s = time.monotonic() - started
                break
            if connection_dropped(sock, timeout_s=0.4):
                dropped_s = time.monotonic() - started
                break
            if time.monotonic() - started > 4 * DEADLINE_S:
                break
    finally:
        sock.close()
    assert dropped_s is not None, f"still connected after {4 * DEADLINE_S} s of a slow handshake"
    assert dropped_s >= DEADLINE_S * 0.9
    wait_for(
        lambda: metric(cluster, DECODE, BAD_FRAMES, reason="timeout") - before == 1,
        5,
        "the cut-off handshake counted",
    )
    _room_lands(cluster, 1)  # the receiver serves its real peer as before


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """Keep every stranger's handshake alive: one more byte of a prefix every second."""
    hello = prefix(Kind.HANDSHAKE, 100)
    for byte in hello:
        for sock in socks:
            try:
                sock.send(bytes([byte]), socket.MSG_DONTWAIT)
            except OSError:
                pass
        if stop.wait(1.0):
            return


def test_a_flood_of_strangers_does_not_keep_a_real_prefill_out(workdir):
    cluster, address = _cluster(workdir, {})  # its prefill has not connected to the data port yet
    socks: list[socket.socket] = []
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(socks, stop), daemon=True)
    try:
        for _ in range(FLOOD):
            try:
                socks.append(socket.create_connection(host_port(address), timeout=5))
            except OSError:
                pass
        trickler.start()
        _room_lands(cluster, 2)
        assert metric(cluster, DECODE, BAD_FRAMES, reason="limit_exceeded") >= 1  # strangers evicted
        assert cluster.sidecars[DECODE].proc.poll() is None
    finally:
        stop.set()
        for sock in socks:
            sock.close()
        cluster.close()
