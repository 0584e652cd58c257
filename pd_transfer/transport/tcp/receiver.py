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
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.receiver_rooms import ByteRanges, ReceiverRooms, RoomPolicy
from pd_transfer.transport.regions import Mapped, RegionMemory, map_one
from pd_transfer.transport.tcp.connection import Connection
from pd_transfer.transport.tcp.handshake_gate import arm_deadline, make_room
from pd_transfer.transport.tcp.iovecs import RECEIVE_DIRECT_MIN_NBYTES
from pd_transfer.transport.tcp.sockets import (
    Authenticator,
    configure,
    format_address,
    stop_serving,
)

log = logging.getLogger("pd_transfer.transport.tcp.transport")

RegionLookup = Callable[[str], RegionMemory | None]
LandedCallback = Callable[[str, int, int], None]  # (room, generation, nbytes)


@dataclass
class ReceiverStats:
    chunks_landed: int = 0
    nbytes_landed: int = 0
    transfers_done: int = 0
    refused: Counter = field(default_factory=Counter)  # Reason -> frames refused

    @property
    def frames_refused(self) -> int:
        return sum(self.refused.values())


class TcpReceiver:
    """Serve the regions behind ``regions_lookup`` at ``tcp://bind_host:port``.

    ``port=0`` picks a free port; :attr:`address` is the endpoint to publish.
    ``on_landed(room, generation, nbytes)`` is called on the event loop after
    each complete transfer (before ``done`` goes out). Chunks smaller than
    ``inline_nbytes`` are received whole and scattered with numpy; larger ones
    straight into place (runs of ``direct_min_nbytes`` or more on average).
    """

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
        self.bind_host = bind_host
        self.port = port
        self._lookup: RegionLookup = (
            regions_lookup.get if isinstance(regions_lookup, Mapping) else regions_lookup
        )
        self.max_chunk_nbytes = max_chunk_nbytes
        self.inline_nbytes = inline_nbytes
        self.direct_min_nbytes = direct_min_nbytes
        self.on_landed = on_landed
        self.auth = auth
        self.handshake_timeout_s = handshake_timeout_s
        self.fence_grace_s = fence_grace_s
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.on_bad_frame = on_bad_frame  # called from connection threads
        self.on_closed = on_closed  # a connection ended (called on the event loop)
        self._authenticated = 0  # connections past the handshake (under _stats_lock)
        self.admission = ReceiverRooms(policy)
        self.stats = ReceiverStats()
        self.address = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: dict[Connection, threading.Thread] = {}
        self._mapped: dict[str, tuple[RegionMemory, Mapped]] = {}
        self._stats_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and start serving; return the address peers connect to."""
        self.loop = asyncio.get_running_loop()
        try:
            listener = socket.create_server(
                (self.bind_host, self.port),
                backlog=128,
                family=socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET,
            )
        except OSError as err:
            raise TransportError(
                f"tcp receiver cannot bind {self.bind_host}:{self.port}: {err}", code=Reason.TRANSPORT_FAILED
            ) from None
        listener.setblocking(False)
        self._listener = listener
        self.address = format_address(self.bind_host, listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(), name=f"tcp-receiver-{self.address}")
        return self.address

    async def stop(self) -> None:
        await stop_serving(self)

    async def __aenter__(self) -> TcpReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- rooms (see ReceiverRooms) ------------------------------------------------------
    def expect(self, room: str, generation: int, ranges: Mapping[str, ByteRanges]) -> None:
        """Admit chunks of ``room`` at ``generation``, only inside ``ranges`` (per region)."""
        self.admission.expect(room, generation, ranges)

    def forget(self, room: str) -> None:
        """The room is finished: refuse its later chunks."""
        self.admission.forget(room)

    def forget_room(self, room: str) -> None:
        """Drop the fence and expectation of a room that is finished for good."""
        self.admission.forget_room(room)

    async def fence(self, room: str, generation: int) -> None:
        """Refuse every later chunk of ``room`` with a generation <= ``generation``.

        Returns once no chunk of it can still be written.
        """
        self.admission.fence(room, generation)
        if not self.admission.busy(room, generation):
            return
        if await asyncio.to_thread(self.admission.wait_idle, room, generation, self.fence_grace_s):
            return
        for connection in list(self._connections):  # a chunk stalled mid-payload: cut it off
            ticket = connection.landing
            if ticket is not None and ticket.room == room and ticket.generation <= generation:
                log.warning(
                    "tcp receiver %s: closing %s: its chunk of fenced room %s is stalled",
                    self.address,
                    connection.where,
                    room,
                )
                connection.shutdown()
        await asyncio.to_thread(self.admission.wait_idle, room, generation, None)

    # -- for the connections ----------------------------------------------------------
    def region(self, region_id: str) -> Mapped:
        memory = self._lookup(region_id)
        if memory is None:
            raise TransportError(f"region {region_id!r} is not registered here", code=Reason.UNKNOWN_REGION)
        cached = self._mapped.get(region_id)
        if cached is None or cached[0] is not memory:
            cached = self._mapped[region_id] = (memory, map_one(region_id, memory, "destination"))
        return cached[1]

    def count(self, code: Reason) -> None:
        with self._stats_lock:
            self.stats.refused[code] += 1

    def bad_frame(self, code: Reason, why: str, where: str, *, logged: bool = True) -> None:
        """A frame (or connection) refused for breaking the stream: counted, reported, logged
        (the log filter rate-limits repeats of one line, per reason)."""
        self.count(code)
        self.on_bad_frame(code.value)
        if logged:
            log.warning(
                "tcp receiver %s: closing %s [%s]: %s",
                self.address,
                where,
                code.value,
                why,
                extra={"reason": code.value},
            )

    def admit_authenticated(self, connection: Connection) -> bool:
        """Take an authenticated connection's slot; False (it is refused) when all are held."""
        with self._stats_lock:
            full = self._authenticated >= self.max_connections
            if not full:
                self._authenticated += 1
                connection.holds_slot = True
        if full:
            self.bad_frame(
                Reason.LIMIT_EXCEEDED,
                f"{self.max_connections} authenticated connections already (max_connections)",
                connection.where,
            )
        return not full

    def landed(self, nbytes: int) -> None:
        with self._stats_lock:
            self.stats.chunks_landed += 1
            self.stats.nbytes_landed += nbytes

    def transfer_done(self) -> None:
        with self._stats_lock:
            self.stats.transfers_done += 1

    # -- accepting ----------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as err:  # e.g. out of descriptors: keep serving the others
                log.warning("tcp receiver %s: accept failed: %s", self.address, err)
                await asyncio.sleep(0.1)
                continue
            where = f"peer {peer[0]}:{peer[1]}"
            if self.auth is None and len(self._connections) >= self.max_connections:
                self.bad_frame(
                    Reason.LIMIT_EXCEEDED,
                    f"{len(self._connections)} connections already (max_connections)",
                    where,
                )
                sock.close()
                continue
            if self.auth is not None:
                make_room(self._connections, self.max_pending)
            sock.setblocking(True)
            configure(sock)
            connection = Connection(self, sock, where)
            thread = threading.Thread(
                target=self._serve, args=(connection,), daemon=True, name=f"pdt-tcp-recv-{peer[1]}"
            )
            self._connections[connection] = thread
            if self.auth is not None:
                arm_deadline(loop, connection, self.handshake_timeout_s)
            thread.start()

    def _ended(self, connection: Connection) -> None:
        self._connections.pop(connection, None)
        self.on_closed()

    def _serve(self, connection: Connection) -> None:
        try:
            connection.serve()
        finally:
            if connection.holds_slot:
                with self._stats_lock:
                    self._authenticated -= 1
            try:
                self.loop.call_soon_threadsafe(self._ended, connection)
            except RuntimeError:
                pass  # the loop is gone
