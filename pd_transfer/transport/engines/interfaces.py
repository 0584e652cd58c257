"""Which network interface holds an address: how an engine is told where to listen.

UCX (under NIXL) takes no address to bind: its tcp transport listens on every
network device it uses, each on that device's address (here: ``127.0.0.1`` on
``lo`` and ``192.0.2.2`` on ``eth0``, with ``data_host = 127.0.0.1``). It
takes a list of devices instead (``NET_DEVICES``), so a sidecar that binds
``data_host`` names the device that holds it: :func:`device_of`.

Reads the interfaces with ``getifaddrs(3)`` through ctypes (Linux and the
BSDs); no network I/O beyond resolving a host name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket

from pd_transfer.errors import Reason, TransportError
from pd_transfer.observability.listeners import WILDCARDS


class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("dstaddr", ctypes.POINTER(_Sockaddr)),
    ("data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, str]]:
    """``(device, address)`` for every IPv4 and IPv6 address of this host's interfaces."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr:
                family, data = item.addr.contents.family, bytes(item.addr.contents.data)
                if family == socket.AF_INET:  # sockaddr_in: port (2 bytes), then the address
                    found.append((item.name.decode(), socket.inet_ntop(family, data[2:6])))
                elif family == socket.AF_INET6:  # sockaddr_in6: port, flow info, then the address
                    found.append((item.name.decode(), socket.inet_ntop(family, data[6:22])))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def device_of(host: str, field: str = "data_host") -> str:
    """The network device that holds ``host`` ("" for a wildcard: every device).

    TransportError ``invalid_config`` where no interface of this host holds it,
    naming the addresses it has.
    """
    if not host or host.strip("[]") in WILDCARDS:
        return ""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
        except (OSError, ValueError) as err:
            raise TransportError(
                f"{field} {host!r} does not resolve: {err}", code=Reason.INVALID_CONFIG
            ) from None
    held = interface_addresses()
    for device, candidate in held:
        if ipaddress.ip_address(candidate.split("%")[0]) == address:
            return device
    if address.is_loopback:
        for device, candidate in held:
            if ipaddress.ip_address(candidate.split("%")[0]).is_loopback:
                return device  # 127.0.0.2 and friends: lo answers the whole 127/8
    raise TransportError(
        f"{field} {host!r} is not an address of this host's interfaces "
        f"({', '.join(f'{d} {a}' for d, a in held) or 'none found'})",
        code=Reason.INVALID_CONFIG,
        hint=f"set {field} to one of them, or to 0.0.0.0 to listen on every interface",
    )
