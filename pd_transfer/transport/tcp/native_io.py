"""``sendmsg``/``recvmsg`` over iovec arrays that numpy builds: no Python object per run.

``socket.sendmsg`` and ``recvmsg_into`` need one buffer object per iovec; for
a 16 MiB chunk of 16 KiB pages that is a thousand memoryviews a call, whose
creation (and the garbage collections they set off, in a process that
imported torch) cost about as much CPU as the copies themselves. Here the
iovecs are one ``(n, 2)`` uint64 array (address, length), computed from the
region's base address and the chunk's offsets in a few numpy operations, and
libc's ``sendmsg``/``recvmsg`` are called through ctypes, which releases the
GIL for the call.

Safety: every address is a region's base plus an offset that was
bounds-checked against that region before (the sender's plan check, the
receiver's :func:`~pd_transfer.transport.copy.packing.check_wire`), and the caller keeps the regions
alive for the call. Little-endian Linux only (the ``msghdr`` layout below is
glibc's and, with zero padding, musl's); elsewhere :data:`AVAILABLE` is False
and :mod:`~pd_transfer.transport.tcp.sockets` falls back to memoryviews.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys

import numpy as np

IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))


class PeerClosed(ConnectionError):
    """The other side closed the connection (in the middle of a frame if ``partial``)."""

    def __init__(self, partial: bool = True) -> None:
        super().__init__("connection closed by the peer" + (" mid-frame" if partial else ""))
        self.partial = partial


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


def _load():
    if (
        not sys.platform.startswith("linux")
        or sys.byteorder != "little"
        or ctypes.sizeof(ctypes.c_void_p) != 8
        or os.environ.get("PD_TRANSFER_NO_NATIVE_IO")
    ):
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        send, recv = libc.sendmsg, libc.recvmsg
    except (OSError, AttributeError):
        return None, None
    for fn in (send, recv):
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Msghdr), ctypes.c_int]
        fn.restype = ctypes.c_ssize_t
    return send, recv


_sendmsg, _recvmsg = _load()
AVAILABLE = _sendmsg is not None
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)
_RECV_FLAGS = socket.MSG_WAITALL


def send_iov(sock: socket.socket, iov: np.ndarray) -> None:
    """Send every byte the ``(n, 2)`` uint64 ``(address, length)`` rows of ``iov`` point at."""
    _transfer(sock, iov, _sendmsg, _SEND_FLAGS, receiving=False)


def recv_iov(sock: socket.socket, iov: np.ndarray) -> None:
    """Fill every byte the rows of ``iov`` point at (writable memory) from ``sock``."""
    _transfer(sock, iov, _recvmsg, _RECV_FLAGS, receiving=True)


def _transfer(sock: socket.socket, iov: np.ndarray, call, flags: int, *, receiving: bool) -> None:
    iov = np.ascontiguousarray(iov, np.uint64)  # consumed below: partial calls move its rows
    header = _Msghdr()
    fd = sock.fileno()
    i, n = 0, len(iov)
    while i < n:
        group = iov[i : i + IOV_MAX]
        header.msg_iov = group.__array_interface__["data"][0]
        header.msg_iovlen = len(group)
        done = call(fd, ctypes.byref(header), flags)
        if done < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code))
        ends = np.cumsum(group[:, 1])
        if done == int(ends[-1]):
            i += len(group)
            continue
        if done == 0 and receiving:
            raise PeerClosed()
        k = int(np.searchsorted(ends, done, side="right"))  # rows wholly done
        i += k
        partly = done - (int(ends[k - 1]) if k else 0)
        iov[i, 0] += np.uint64(partly)
        iov[i, 1] -= np.uint64(partly)
