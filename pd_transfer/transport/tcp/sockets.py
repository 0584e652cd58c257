"""Framed, blocking socket I/O for the tcp data plane: scatter/gather with no copy of ours.

Every frame on a data connection starts with a fixed 20-byte prefix::

    magic "PDTD" | version u8 | kind u8 | reserved u16 | header_nbytes u32 | payload_nbytes u64

then ``header_nbytes`` of msgpack header (:mod:`~pd_transfer.transport.tcp.frames`, or a handshake
message) and ``payload_nbytes`` of raw bytes (a chunk's payload; 0 for every
other frame). Kinds: HANDSHAKE (the authentication exchange, before anything
else), DATA (sender -> receiver: chunk and end headers), REPLY (receiver ->
sender: ack, done, fail).

The payload never passes through a buffer of ours: :func:`send_part` hands
the kernel the source regions' runs themselves and :func:`recv_part` lets it
write straight into the destination's runs (:mod:`~pd_transfer.transport.tcp.iovecs` builds the parts),
through :mod:`~pd_transfer.transport.tcp.native_io` where it is available, else ``socket.sendmsg`` and
``socket.recvmsg_into`` (MSG_WAITALL) on memoryviews (:func:`send_all`,
:func:`recv_all_into`). Either takes at most IOV_MAX buffers a call and
resumes after partial transfers. A prefix that is not ours (wrong magic, version, kind, or a size
over the limits) desynchronises the stream: :func:`read_prefix` raises and
the connection is closed.

These calls block; the transport runs them in one thread per connection,
where they release the GIL. Sans asyncio; imports only the standard library.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, overload

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.tcp import native_io
from pd_transfer.transport.tcp.native_io import IOV_MAX, PeerClosed

MAGIC = b"PDTD"
VERSION = 1
PREFIX = struct.Struct("<4sBBHIQ")
MAX_HANDSHAKE_NBYTES = 4096
#: codes of frames that break the stream (not ours, or over the limits): bad frames
STREAM_ERRORS = frozenset({Reason.BAD_FRAME, Reason.VERSION_UNSUPPORTED, Reason.FRAME_TOO_LARGE})
_DISCARD_NBYTES = 1 << 20


class Kind(enum.IntEnum):
    HANDSHAKE = 1
    DATA = 2
    REPLY = 3


@dataclass(frozen=True)
class Prefix:
    kind: Kind
    header_nbytes: int
    payload_nbytes: int


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``tcp://[v6]:port``) -> ``(host, port)``."""
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if (
        not address.startswith("tcp://")
        or not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
    ):
        raise TransportError(f"data address {address!r} is not tcp://host:port", code=Reason.TRANSPORT_FAILED)
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def configure(sock: socket.socket) -> None:
    """Options of every data connection: no Nagle delay (acks and headers are small)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def shutdown(sock: socket.socket) -> None:
    """End both directions of ``sock`` now, waking any thread blocked on it; an already
    dead socket is no error."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def prefix(kind: Kind, header_nbytes: int, payload_nbytes: int = 0) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, int(kind), 0, header_nbytes, payload_nbytes)


def send_frame(
    sock: socket.socket,
    kind: Kind,
    header: bytes,
    payload: Sequence[memoryview] = (),
    payload_nbytes: int = 0,
) -> None:
    """One frame: prefix, header, then the payload buffers (``payload_nbytes`` in all)."""
    send_all(sock, [memoryview(prefix(kind, len(header), payload_nbytes)), memoryview(header), *payload])


def send_part(sock: socket.socket, part) -> None:
    """Send an :class:`~pd_transfer.transport.tcp.iovecs.Part` (natively when possible)."""
    if native_io.AVAILABLE:
        native_io.send_iov(sock, part.iov())
    else:
        send_all(sock, part.views())


def recv_part(sock: socket.socket, part) -> None:
    """Receive an :class:`~pd_transfer.transport.tcp.iovecs.Part` (natively when possible)."""
    if native_io.AVAILABLE:
        native_io.recv_iov(sock, part.iov())
    else:
        recv_all_into(sock, part.views())


def send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """``sendmsg`` every byte of ``views`` (1-D byte memoryviews; consumed), IOV_MAX at a time."""
    i, n = 0, len(views)
    while i < n:
        group = views[i : i + IOV_MAX]
        sent = sock.sendmsg(group)
        if sent == sum(map(len, group)):
            i += len(group)
            continue
        i = _advance(views, i, sent)


def recv_all_into(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every byte of ``views`` (writable 1-D byte memoryviews; consumed) from ``sock``."""
    i, n = 0, len(views)
    while i < n:
        group = views[i : i + IOV_MAX]
        got = sock.recvmsg_into(group, 0, socket.MSG_WAITALL)[0]
        wanted = sum(len(view) for view in group)
        if got == 0 and wanted:
            raise PeerClosed()
        if got == wanted:
            i += len(group)
            continue
        i = _advance(views, i, got)


def _advance(views: list[memoryview], i: int, nbytes: int) -> int:
    """Drop ``nbytes`` from the front of ``views[i:]``; return the first unfinished index."""
    while i < len(views):
        size = len(views[i])
        if nbytes < size:
            if nbytes:
                views[i] = views[i][nbytes:]
            return i
        nbytes -= size
        i += 1
    return i


@overload
def recv_exact(sock: socket.socket, nbytes: int, *, at_boundary: Literal[False] = False) -> bytes: ...
@overload
def recv_exact(sock: socket.socket, nbytes: int, *, at_boundary: bool) -> bytes | None: ...
def recv_exact(sock: socket.socket, nbytes: int, *, at_boundary: bool = False) -> bytes | None:
    """Exactly ``nbytes`` bytes; None for a clean end of stream before the first byte when
    ``at_boundary`` (between frames), :class:`PeerClosed` for any other end."""
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    got = 0
    while got < nbytes:
        k = sock.recv_into(view[got:], nbytes - got, socket.MSG_WAITALL)
        if k == 0:
            if at_boundary and got == 0:
                return None
            raise PeerClosed()
        got += k
    return bytes(buffer)


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (the payload of a refused chunk: the stream stays in step)."""
    scratch = memoryview(bytearray(min(nbytes, _DISCARD_NBYTES)))
    while nbytes:
        k = sock.recv_into(scratch, min(nbytes, len(scratch)))
        if k == 0:
            raise PeerClosed()
        nbytes -= k


def read_prefix(sock: socket.socket, *, max_header_nbytes: int, max_payload_nbytes: int) -> Prefix | None:
    """The next frame's prefix; None at a clean end of stream.

    Raises :class:`TransportError` (BAD_FRAME, VERSION_UNSUPPORTED or
    FRAME_TOO_LARGE) for a prefix that is not ours: the caller closes the
    connection, since the stream can no longer be followed.
    """
    raw = recv_exact(sock, PREFIX.size, at_boundary=True)
    if raw is None:
        return None
    magic, version, kind, _reserved, header_nbytes, payload_nbytes = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise TransportError(f"not a pd-transfer data stream (starts {magic!r})", code=Reason.BAD_FRAME)
    if version != VERSION:
        raise TransportError(
            f"data stream version {version} is not {VERSION}", code=Reason.VERSION_UNSUPPORTED
        )
    if kind not in Kind._value2member_map_:
        raise TransportError(f"data stream frame kind {kind} is unknown", code=Reason.BAD_FRAME)
    if header_nbytes > max_header_nbytes or payload_nbytes > max_payload_nbytes:
        raise TransportError(
            f"frame of {header_nbytes} header and {payload_nbytes} payload "
            f"bytes exceeds the limits ({max_header_nbytes}, "
            f"{max_payload_nbytes})",
            code=Reason.FRAME_TOO_LARGE,
        )
    return Prefix(Kind(kind), header_nbytes, payload_nbytes)


class FrameChannel:
    """Handshake frames over one connection, for the authentication hooks.

    ``recv`` raises :class:`TransportError` for a frame that is not a
    handshake frame: UNAUTHENTICATED when the peer sent data first, AUTH_FAILED
    when it answered with a reply (a receiver that runs no handshake).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, frame: bytes) -> None:
        send_frame(self.sock, Kind.HANDSHAKE, frame)

    def recv(self) -> bytes:
        head = read_prefix(self.sock, max_header_nbytes=MAX_HANDSHAKE_NBYTES, max_payload_nbytes=0)
        if head is None:
            raise PeerClosed(partial=False)
        body = recv_exact(self.sock, head.header_nbytes)
        if head.kind is Kind.DATA:
            raise TransportError(
                "the peer sent data before completing the authentication handshake",
                code=Reason.UNAUTHENTICATED,
            )
        if head.kind is Kind.REPLY:
            raise TransportError(
                "the peer answered the authentication handshake with a data-"
                "plane reply: is authentication on at both ends?",
                code=Reason.AUTH_FAILED,
            )
        return body


class Authenticator(Protocol):
    """The handshake a data connection runs before its first frame; the agent builds it
    (from its shared secret) so that this layer needs no security code of its own.

    Every method raises :class:`TransportError` with an AUTH_* or UNAUTHENTICATED
    code when the peer is refused; the hook counts and logs its own refusals.
    """

    def client(self, channel: FrameChannel, peer: str) -> None:
        """Connecting side: prove the secret and check the listener's proof."""

    def server(self, first_frame: bytes, channel: FrameChannel, where: str) -> str:
        """Listening side, given the connection's first (handshake) frame: the peer's id."""

    def unauthenticated(self, where: str) -> None:
        """Count a connection that sent data before the handshake (it is closed)."""


async def stop_serving(server) -> None:
    """Stop a threaded connection server (the tcp receiver, the staging receiver): no
    more accepts, the listener closed, every connection shut and its thread joined.

    ``server`` has ``_accepting`` (the accept task), ``_listener`` and ``_connections``
    (connection -> its thread).
    """
    if server._accepting is not None:
        server._accepting.cancel()
        await asyncio.gather(server._accepting, return_exceptions=True)
        server._accepting = None
    if server._listener is not None:
        server._listener.close()
        server._listener = None
    connections = list(server._connections.items())
    for connection, _ in connections:
        connection.shutdown()
    await asyncio.to_thread(lambda: [thread.join() for _, thread in connections])
