"""A loopback TCP port to hand to a process that will bind it later.

Binding port 0, reading the port and closing the socket leaves a window: until
the child process binds it, the kernel may give the same port to any
``connect()`` on the host as its local (ephemeral) port, and the child then
fails with "Address already in use". Ports outside the kernel's ephemeral
range are never handed out that way, so :func:`spare_port` picks one of
those that is free now, and never the same one twice in a process.
Standard library only.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_RANGE = (32768, 60999)  # Linux's default ephemeral range
_LOWEST = 10000  # below this sit well-known and registered services
_TRIES = 200
_given: set[int] = set()
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, inclusive; Linux's default when unreadable."""
    try:
        with open(_RANGE_FILE) as handle:
            low, high = (int(part) for part in handle.read().split())
    except (OSError, ValueError):
        return _DEFAULT_RANGE
    return (low, high) if 0 < low <= high <= 65535 else _DEFAULT_RANGE


def _candidates(low: int, high: int) -> list[range]:
    spans = [range(_LOWEST, low), range(high + 1, 65536)]
    return [span for span in spans if len(span) > 0]


def spare_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that is free now and outside the ephemeral range.

    Falls back to a kernel-chosen port (with the window described above) only
    when no port outside the range can be bound after a few hundred tries.
    """
    spans = _candidates(*ephemeral_range())
    for _ in range(_TRIES if spans else 0):
        span = _rng.choice(spans)
        port = span[_rng.randrange(len(span))]
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
