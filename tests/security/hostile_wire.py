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


def zmtp_ready(socket_type: bytes = b"DEALER", routing_id: bytes | None = None) -> bytes:
    properties = {b"Socket-Type": socket_type}
    if routing_id is not None:
        properties[b"Identity"] = routing_id
    body = b"\x05READY" + b"".join(
        bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        for name, value in properties.items()
    )
    return bytes([0x04, len(body)]) + body


def zmtp_send(sock: socket.socket, body: bytes) -> None:
    """One single-part ZMTP message."""
    header = bytes([0x00, len(body)]) if len(body) < 256 else b"\x02" + struct.pack(">Q", len(body))
    sock.sendall(header + body)


def zmtp_read(sock: socket.socket, timeout_s: float) -> tuple[list[bytes], bool]:
    """The messages that arrive within ``timeout_s``, and whether the peer closed."""
    sock.settimeout(0.1)
    buffer, deadline = b"", time.monotonic() + timeout_s
    closed = False
    while time.monotonic() < deadline and not closed:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            piece = b""
        closed = not piece
        buffer += piece
    messages = []
    while len(buffer) >= 2:
        long = buffer[0] & 0x02
        size_nbytes = 8 if long else 1
        size = struct.unpack(">Q", buffer[1:9])[0] if long else buffer[1]
        if len(buffer) < 1 + size_nbytes + size:
            break
        body = buffer[1 + size_nbytes : 1 + size_nbytes + size]
        if not buffer[0] & 0x04:  # a command (PING): not a message
            messages.append(body)
        buffer = buffer[1 + size_nbytes + size :]
    return messages, closed


def zmtp_connect(address: tuple[str, int] | str, routing_id: bytes | None = None) -> socket.socket:
    """A TCP (``(host, port)``) or Unix (a path: ``ipc://``) connection that completed
    ZeroMQ's NULL handshake as a DEALER (with ``routing_id``, if given)."""
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
    sock.sendall(zmtp_ready(routing_id=routing_id))
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
