"""The listening sockets of a process, read from ``/proc`` (Linux).

A sidecar's own sockets bind the hosts its config names; an engine it loads
(Mooncake, NIXL's UCX) opens listeners of its own, in C, where Python cannot
see them. :func:`listening` finds every listening TCP socket a process holds,
its own and its libraries' (all threads share one descriptor table): each
descriptor that is a socket names an inode, and ``/proc/<pid>/net/tcp`` and
``tcp6`` list each socket's inode, local address and state (``0A``: LISTEN).
A sidecar measures an engine's listeners this way at start, as the set it
holds after starting the engine less the set before; the tests take the same
census of a whole sidecar process, Unix sockets too (:func:`unix_listening`,
from ``/proc/<pid>/net/unix``).

Standard library only; where ``/proc`` cannot be read the answer is empty.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's "Flags": a listening socket
WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True, order=True)
class Listener:
    host: str  # the bound address as the kernel reports it: "0.0.0.0" and "::" bind every interface
    port: int

    @property
    def wildcard(self) -> bool:
        return self.host in WILDCARDS

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def listening(pid: int | str = "self") -> set[Listener]:
    """The TCP sockets process ``pid`` listens on (empty where ``/proc`` cannot be read)."""
    inodes = _socket_inodes(pid)
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[9]) in inodes:
                found.add(_decode(fields[1], family))
    return found


def unix_listening(pid: int | str = "self") -> set[str]:
    """The paths of the Unix stream sockets process ``pid`` listens on ("@name": abstract)."""
    inodes = _socket_inodes(pid)
    try:
        with open(f"/proc/{pid}/net/unix") as handle:
            rows = handle.read().splitlines()[1:]
    except OSError:
        return set()
    # Num RefCount Protocol Flags Type St Inode [Path]
    return {
        fields[7] if len(fields) > 7 else ""
        for fields in (row.split() for row in rows)
        if len(fields) > 6 and int(fields[3], 16) & _ACCEPTING and int(fields[6]) in inodes
    }


def _socket_inodes(pid: int | str) -> set[int]:
    inodes: set[int] = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _decode(local: str, family: int) -> Listener:
    """``0100007F:1F90`` -> 127.0.0.1:8080: the address as the kernel's 32-bit words in host
    (little-endian) order, the port in hex."""
    address, port = local.split(":")
    raw = bytes.fromhex(address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    host = socket.inet_ntop(family, words)
    if host.startswith("::ffff:") and "." in host:  # an IPv4 address on a dual-stack socket
        host = host[len("::ffff:") :]
    return Listener(host, int(port, 16))
