"""The tcp transport's receiving side: a listening socket, one thread per peer connection.

One :class:`TcpReceiver` per decode rank serves every prefill peer. It
accepts connections on the event loop and serves each in its own thread
(:class:`~pd_transfer.transport.tcp.connection.Connection`): the handshake first when ``auth`` is
set, then frames in arrival order, each chunk checked before its payload is
received straight into the destination regions. A frame that fails any check
is refused with a reason, counted in :attr:`TcpReceiver.stats`, and never
written; the transfer it belongs to is failed (the sender's ``write`` raises
with that reason), and the receiver keeps serving everyone else.

Which rooms may write where is the :class:`~pd_transfer.transport.receiver_rooms.ReceiverRooms`'s
call. The decode agent runs the receiver with
``policy=RoomPolicy.EXPECTED``: it announces each room's generation and
destination byte ranges with :meth:`TcpReceiver.expect` before asking
prefill for it, and :meth:`forget`-s it once done; a chunk of any other room,
or outside the room's pages, is refused. The default (ANY) admits any room
not fenced, within the registered regions: for standalone use (tests,
benchmarks).

After :meth:`TcpReceiver.fence` returns, no chunk of the fenced room
generation can still land: chunks arriving later are refused, a chunk that
was already landing is waited for (and after ``fence_grace_s`` its
connection is shut down, so a stalled peer cannot hold the fence open).

Strangers: with ``auth``, a connection is *pending* from its accept until
it authenticated, and must do so within ``handshake_timeout_s`` (one deadline
for the whole handshake; see :mod:`~pd_transfer.transport.tcp.connection`). At most
``max_pending`` connections are pending at once: one more accepted shuts
the oldest pending one down, so a flood of idle or slow connections cannot
keep a real peer, which authenticates in a round trip or two, from getting
in. Authenticated connections are capped separately (``max_connections``).
Frames that break the stream (not ours, over the limits, data before the
handshake, a handshake cut off) are logged, counted in
:attr:`TcpReceiver.stats` and reported to ``on_bad_frame(reason)``; every
connection that ends, for whatever reason, is reported to ``on_closed()``.

Threads: see :mod:`~pd_transfer.transport.tcp.transport` for why this layer uses them. Encryption: none; see
:mod:`~pd_transfer.transport.zmq.receiver` for the CURVE variant.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping
from typing import ClassVar

from pd_transfer.transport.receiver_rooms import RoomPolicy
from pd_transfer.transport.regions import Mapped, MappedCache, RegionMemory
from pd_transfer.transport.tcp.connection import Connection
from pd_transfer.transport.tcp.iovecs import RECEIVE_DIRECT_MIN_NBYTES
from pd_transfer.transport.tcp.serving import ReceiverStats, ThreadedReceiver
from pd_transfer.transport.tcp.sockets import Authenticator

log = logging.getLogger("pd_transfer.transport.tcp.transport")

RegionLookup = Callable[[str], RegionMemory | None]
LandedCallback = Callable[[str, int, int], None]  # (room, generation, nbytes)

__all__ = ["LandedCallback", "ReceiverStats", "RegionLookup", "TcpReceiver"]


class TcpReceiver(ThreadedReceiver):
    """Serve the regions behind ``regions_lookup`` at ``tcp://bind_host:port``.

    ``port=0`` picks a free port; :attr:`address` is the endpoint to publish.
    ``on_landed(room, generation, nbytes)`` is called on the event loop after
    each complete transfer (before ``done`` goes out). Chunks smaller than
    ``inline_nbytes`` are received whole and scattered with numpy; larger ones
    straight into place (runs of ``direct_min_nbytes`` or more on average).
    """

    label: ClassVar[str] = "tcp receiver"
    thread_prefix: ClassVar[str] = "pdt-tcp-recv"
    task_prefix: ClassVar[str] = "tcp-receiver"
    log: ClassVar[logging.Logger] = log

    def __init__(
        self,
        bind_host: str,
        regions_lookup: RegionLookup | Mapping[str, RegionMemory],
        *,
        port: int = 0,
        max_chunk_nbytes: int = 64 << 20,
        inline_nbytes: int = 256 << 10,
        direct_min_nbytes: int = RECEIVE_DIRECT_MIN_NBYTES,
        on_landed: LandedCallback | None = None,
        auth: Authenticator | None = None,
        policy: RoomPolicy = RoomPolicy.ANY,
        handshake_timeout_s: float = 10.0,
        fence_grace_s: float = 2.0,
        max_connections: int = 1024,
        max_pending: int = 64,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_closed: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(
            bind_host,
            port,
            auth=auth,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
            max_pending=max_pending,
            on_bad_frame=on_bad_frame,
            on_closed=on_closed,
            policy=policy,
        )
        self._lookup: RegionLookup = (
            regions_lookup.get if isinstance(regions_lookup, Mapping) else regions_lookup
        )
        self.max_chunk_nbytes = max_chunk_nbytes
        self.inline_nbytes = inline_nbytes
        self.direct_min_nbytes = direct_min_nbytes
        self.on_landed = on_landed
        self.fence_grace_s = fence_grace_s
        self._mapped = MappedCache()

    def _connection(self, sock: socket.socket, where: str) -> Connection:
        return Connection(self, sock, where)

    async def _settle(self, room: str, generation: int) -> None:
        """Wait for chunks of the fenced room still landing; after ``fence_grace_s`` shut
        down the connection of one stalled mid-payload, so a stalled peer cannot hold the
        fence open."""
        if not self.admission.busy(room, generation):
            return
        if await asyncio.to_thread(self.admission.wait_idle, room, generation, self.fence_grace_s):
            return
        for connection in list(self._connections):  # a chunk stalled mid-payload: cut it off
            ticket = connection.landing if isinstance(connection, Connection) else None  # (all are)
            if ticket is not None and ticket.room == room and ticket.generation <= generation:
                log.warning(
                    "tcp receiver %s: closing %s: its chunk of fenced room %s is stalled",
                    self.address,
                    connection.where,
                    room,
                )
                connection.shutdown()
        await asyncio.to_thread(self.admission.wait_idle, room, generation, None)

    def region(self, region_id: str) -> Mapped:
        """The destination region ``region_id``, mapped (for the connections)."""
        return self._mapped.destination(self._lookup, region_id)
