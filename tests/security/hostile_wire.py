"""A stranger's raw sockets: ZMTP spoken by hand, data-port prefixes, a sidecar's memory."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

MiB = 1 << 20


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (or ``VmHWM``, the peak) of process ``pid`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(f"{field} not in /proc/{pid}/status")


def zmtp_greeting() -> bytes:
    """ZMTP 3.0 greeting of a NULL-mechanism client (64 bytes)."""
    return (
        b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    )


def zmtp_ready(socket_type: bytes = b"DEALER") -> bytes:
    body = (
        b"\x05READY"
        + bytes([len(b"Socket-Type")])
        + b"Socket-Type"
        + struct.pack(">I", len(socket_type))
        + socket_type
    )
    return bytes([0x04, len(body)]) + body


def zmtp_connect(address: tuple[str, int] | str) -> socket.socket:
    """A TCP (``(host, port)``) or Unix (a path: ``ipc://``) connection that completed
    ZeroMQ's NULL handshake as a DEALER."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(address)
    else:
        sock = socket.create_connection(address, timeout=5)
    sock.sendall(zmtp_greeting())
    greeting = b""
    while len(greeting) < 64:
        piece = sock.recv(64 - len(greeting))
        if not piece:
            raise ConnectionError("the listener closed during the ZMTP greeting")
        greeting += piece
    sock.sendall(zmtp_ready())
    return sock


def send_oversized_frame(sock: socket.socket, declared: int, nbytes: int) -> int:
    """Declare one ZMTP frame of ``declared`` bytes and send up to ``nbytes`` of it;
    returns how many payload bytes the listener took before it dropped the connection."""
    sock.sendall(b"\x02" + struct.pack(">Q", declared))
    piece = b"\x00" * MiB
    sent = 0
    try:
        while sent < nbytes:
            sent += sock.send(piece)
    except OSError:
        pass
    return sent


def connection_dropped(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True once the peer closed or reset the connection (reads what is left)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(interval_s)
