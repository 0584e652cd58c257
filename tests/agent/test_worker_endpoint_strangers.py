"""What a local stranger can do to the worker endpoint: little, and not for long.

The socket file is mode 0600 on ``unix://`` and on ``ipc://`` alike, whatever the
umask. On ``unix://``, a connection that has not authenticated may send a frame of
at most 4 KiB, has one deadline for its handshake, and waits among at most 64 such
connections; partial frames held by strangers are cut there, and the sidecar's
memory comes back to where it started once they are gone. Real sidecar processes,
real sockets; the bounds are generous, the deadlines upper bounds only.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
from cluster import Sidecar

from pd_transfer.agent.stream_router import MAX_PENDING, PRE_AUTH_FRAME_NBYTES
from pd_transfer.client import Client
from pd_transfer.client.errors import Refused

MiB = 1 << 20
DEADLINE_S = 3.0


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="pdt-"))  # short: socket paths hold ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("scheme", ["unix", "ipc"])
def test_the_socket_file_is_0600_even_under_umask_000(workdir, scheme):
    umask = os.umask(0)  # the sidecar inherits it
    try:
        sidecar = Sidecar(workdir, "decode", "d0", {"http_port": 0}, worker_scheme=scheme)
    finally:
        os.umask(umask)
    try:
        sidecar.wait_ready()
        mode = os.lstat(sidecar.endpoint.split("://", 1)[1]).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)
        _serves(sidecar)
    finally:
        sidecar.stop()


def _serves(sidecar) -> None:
    """A real client authenticates and is answered (no worker registered: not_registered)."""
    with (
        Client(sidecar.endpoint, "probe", timeout_s=10) as client,
        pytest.raises(Refused, match="not_registered"),
    ):
        client.expect(1, "tcp://127.0.0.1:1", [0])


def _rss_nbytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _bad_frames(sidecar, ready: dict, reason: str) -> float:
    import urllib.request

    with urllib.request.urlopen(ready["http_address"] + "/metrics", timeout=5) as response:
        text = response.read().decode()
    line = f'pd_transfer_bad_frames_total{{reason="{reason}",role="decode"}} '
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def _connect(sidecar) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(sidecar.endpoint.split("://", 1)[1])
    return sock


def _push(sock: socket.socket, nbytes: int) -> None:
    """Send a header announcing ``nbytes``, then as much of them as the sidecar takes."""
    try:
        sock.sendall(struct.pack("<I", nbytes))
        block = b"\0" * MiB
        for _ in range(nbytes // MiB):
            sock.sendall(block)
    except OSError:
        pass  # cut off: what this test expects


def _closed_by_sidecar(sock: socket.socket) -> bool:
    """Read until the sidecar closes the connection (True) or 60 s pass (False)."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


@pytest.fixture
def lone(workdir):
    sidecar = Sidecar(workdir, "decode", "d0", {"http_port": 0, "bootstrap_timeout_s": DEADLINE_S})
    ready = sidecar.wait_ready()
    yield sidecar, ready
    sidecar.stop()


def test_strangers_partial_frames_are_cut_and_the_memory_comes_back(lone):
    sidecar, ready = lone
    _serves(sidecar)
    start_nbytes = _rss_nbytes(sidecar.proc.pid)
    # 16 strangers announce 60 MiB each and push it; 16 more send a small frame's first bytes and stall
    big = [_connect(sidecar) for _ in range(16)]
    pushers = [threading.Thread(target=_push, args=(sock, 60 * MiB)) for sock in big]
    for thread in pushers:
        thread.start()
    stalled = [_connect(sidecar) for _ in range(16)]
    for sock in stalled:
        sock.sendall(struct.pack("<I", PRE_AUTH_FRAME_NBYTES) + b"\x81" * 100)
    for thread in pushers:
        thread.join(timeout=120)
    held_nbytes = _rss_nbytes(sidecar.proc.pid) - start_nbytes
    assert all(_closed_by_sidecar(sock) for sock in big)  # cut at the header
    assert all(_closed_by_sidecar(sock) for sock in stalled)  # cut at the deadline
    for sock in big + stalled:
        sock.close()
    assert held_nbytes < 64 * MiB, f"the sidecar grew by {held_nbytes / MiB:.0f} MiB for strangers' frames"
    after_nbytes = _rss_nbytes(sidecar.proc.pid) - start_nbytes
    assert after_nbytes < 64 * MiB, f"{after_nbytes / MiB:.0f} MiB stayed after the strangers left"
    assert _bad_frames(sidecar, ready, "frame_too_large") >= 16
    assert _bad_frames(sidecar, ready, "timeout") >= 16
    _serves(sidecar)


def test_a_stranger_is_answered_before_it_is_cut_off_for_a_too_large_frame(lone):
    sidecar, _ = lone
    with _connect(sidecar) as sock:
        sock.sendall(struct.pack("<I", PRE_AUTH_FRAME_NBYTES + 1))
        header = sock.recv(4)
        reply = msgpack.unpackb(sock.recv(struct.unpack("<I", header)[0], socket.MSG_WAITALL))
        assert reply["ok"] is False and reply["code"] == "frame_too_large"
        assert "before the connection authenticated" in reply["reason"]
        assert _closed_by_sidecar(sock)


def test_a_flood_of_idle_strangers_cuts_the_oldest_and_a_worker_still_gets_in(lone):
    sidecar, ready = lone
    idle = [_connect(sidecar) for _ in range(MAX_PENDING + 8)]
    try:
        _serves(sidecar)  # authenticates among 64 pending strangers
        assert all(_closed_by_sidecar(sock) for sock in idle[:8])  # the oldest made room
        deadline = time.monotonic() + 60
        while _bad_frames(sidecar, ready, "limit_exceeded") < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _bad_frames(sidecar, ready, "limit_exceeded") >= 8
    finally:
        for sock in idle:
            sock.close()
