"""Staged engine writes, decode side: the staging area and the control channel that scatters it.

A decode rank running an engine transport registers, besides its regions, one
:class:`StagingArea` with its engine (default 16 slots of 4 MiB) and
publishes it with its engine address. Prefill writes gathered chunks into
slots of it with the engine and then says, on a control connection served by
:class:`StagingReceiver`, which slot holds which destination runs
(:mod:`~pd_transfer.transport.engines.staging.wire`). For each such request the receiver

- checks that the slot belongs to this connection's ring and the byte count
  fits the slot,
- checks every run against the regions registered here
  (:func:`~pd_transfer.transport.copy.packing.check_wire`) and the room against
  fences (:class:`~pd_transfer.transport.receiver_rooms.ReceiverRooms`),
- only then scatters the slot into place and acknowledges; a refused chunk is
  answered with a reason and nothing of it is written.

Slots are leased as rings, one per connection (``open``), and come back when
the connection ends, so memory is bounded by the area whatever the number of
prefill peers; a peer that finds no slot free is told so and writes directly.

Connections: one thread per connection, as :class:`~pd_transfer.transport.tcp.receiver.TcpReceiver`
(blocking socket I/O and numpy scatters, which release the GIL), the same
framing (:mod:`~pd_transfer.transport.tcp.sockets`) and, when ``auth`` is set, the same HMAC handshake
before the first frame, behind the same gate (:mod:`~pd_transfer.transport.tcp.handshake_gate`): a
stranger's first frame may declare at most
:data:`~pd_transfer.transport.tcp.sockets.MAX_HANDSHAKE_NBYTES` of header, the whole handshake has one
deadline from the accept, at most ``max_pending`` connections wait for theirs
(one more shuts the oldest down) and ``max_connections`` caps the
authenticated ones. Frames that break the stream, and connections cut off or
refused, are logged, counted and reported to ``on_bad_frame(reason)``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.packing import check_wire, scatter_chunk
from pd_transfer.transport.engines.staging.wire import (
    MAX_HEADER_NBYTES,
    OpenRing,
    Ring,
    Staged,
    decode_request,
)
from pd_transfer.transport.engines.staging.wire import encode as encode_staging
from pd_transfer.transport.receiver_rooms import ReceiverRooms, RoomPolicy
from pd_transfer.transport.regions import Mapped, Regions, map_one
from pd_transfer.transport.tcp.frames import Ack, Fail
from pd_transfer.transport.tcp.frames import encode as encode_reply
from pd_transfer.transport.tcp.handshake_gate import GatedConnection, arm_deadline, make_room
from pd_transfer.transport.tcp.receiver import ReceiverStats
from pd_transfer.transport.tcp.sockets import (
    MAX_HANDSHAKE_NBYTES,
    STREAM_ERRORS,
    Authenticator,
    FrameChannel,
    Kind,
    PeerClosed,
    configure,
    format_address,
    read_prefix,
    recv_exact,
    send_frame,
    stop_serving,
)

log = logging.getLogger(__name__)

DEFAULT_AREA_SLOTS = 16
DEFAULT_SLOT_NBYTES = 4 << 20


class StagingArea:
    """``num_slots`` slots of ``slot_nbytes`` in one buffer, leased out as rings."""

    def __init__(self, num_slots: int = DEFAULT_AREA_SLOTS, slot_nbytes: int = DEFAULT_SLOT_NBYTES) -> None:
        if num_slots < 1 or slot_nbytes < 4096:
            raise TransportError(
                f"a staging area needs at least one slot of 4096 bytes or more, "
                f"got {num_slots} x {slot_nbytes}",
                code=Reason.INVALID_CONFIG,
            )
        self.num_slots, self.slot_nbytes = num_slots, slot_nbytes
        self.buffer = np.zeros(num_slots * slot_nbytes, np.uint8)
        self._free = list(range(num_slots))
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        return int(self.buffer.ctypes.data)

    @property
    def published(self) -> tuple[int, int, int]:
        """``(address, nbytes, slot_nbytes)``, as the engine address carries it."""
        return self.address, self.buffer.nbytes, self.slot_nbytes

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def lease(self, wanted: int) -> tuple[int, ...]:
        with self._lock:
            granted, self._free = self._free[:wanted], self._free[wanted:]
            return tuple(granted)

    def give_back(self, slots: tuple[int, ...]) -> None:
        with self._lock:
            self._free.extend(slots)

    def slot(self, index: int, nbytes: int) -> np.ndarray:
        start = index * self.slot_nbytes
        return self.buffer[start : start + nbytes]


class StagingReceiver:
    """Serve staged-chunk requests for ``regions`` out of ``area`` at ``tcp://bind_host:port``."""

    def __init__(
        self,
        regions: Regions,
        area: StagingArea,
        *,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        auth: Authenticator | None = None,
        handshake_timeout_s: float = 10.0,
        max_connections: int = 256,
        max_pending: int = 64,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.area = area
        self.bind_host, self.port = bind_host, port
        self.auth = auth
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.on_bad_frame = on_bad_frame  # called from connection threads
        self._authenticated = 0  # connections past the handshake (under _stats_lock)
        self.admission = ReceiverRooms(RoomPolicy.ANY)
        self.stats = ReceiverStats()
        self.address = ""
        self._regions: dict[str, Mapped] = {r: map_one(r, m, "destination") for r, m in regions.items()}
        self._sizes = {r: m.nbytes for r, m in self._regions.items()}
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: dict[_Connection, threading.Thread] = {}
        self._stats_lock = threading.Lock()

    async def start(self) -> str:
        try:
            listener = socket.create_server(
                (self.bind_host, self.port),
                backlog=128,
                family=socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET,
            )
        except OSError as err:
            raise TransportError(
                f"staging receiver cannot bind {self.bind_host}:{self.port}: {err}",
                code=Reason.TRANSPORT_FAILED,
            ) from None
        listener.setblocking(False)
        self._listener = listener
        self.address = format_address(self.bind_host, listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(), name=f"staging-{self.address}")
        return self.address

    async def stop(self) -> None:
        await stop_serving(self)

    async def fence(self, room: str, generation: int) -> None:
        """Refuse later chunks of ``room`` up to ``generation``; return once none is landing."""
        self.admission.fence(room, generation)
        if self.admission.busy(room, generation):
            await asyncio.to_thread(self.admission.wait_idle, room, generation, None)

    def count(self, code: Reason) -> None:
        with self._stats_lock:
            self.stats.refused[code] += 1

    def bad_frame(self, code: Reason, why: str, where: str) -> None:
        """A frame or connection refused for breaking the stream or the handshake rules:
        counted, reported, logged."""
        self.count(code)
        self.on_bad_frame(code.value)
        log.warning(
            "staging receiver %s: closing %s [%s]: %s",
            self.address,
            where,
            code.value,
            why,
            extra={"reason": code.value},  # repeats are limited per reason
        )

    def admit_authenticated(self, connection: GatedConnection) -> bool:
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

    def scatter(self, ring: tuple[int, ...], request: Staged) -> None:
        """Check one staged chunk completely, then scatter it; raises before any byte moves."""
        chunk = request.chunk
        if request.slot not in ring:
            raise TransportError(
                f"slot {request.slot} is not one of this connection's staging slots {list(ring)}",
                code=Reason.RUN_OUT_OF_REGION,
            )
        if request.nbytes > self.area.slot_nbytes:
            raise TransportError(
                f"a staged chunk of {request.nbytes} bytes does not fit a slot of {self.area.slot_nbytes}",
                code=Reason.RUN_OUT_OF_REGION,
            )
        unknown = [r for r in chunk.wire.regions if r not in self._sizes]
        if unknown:
            raise TransportError(
                f"chunk names unregistered region(s) {unknown[:5]}", code=Reason.UNKNOWN_REGION
            )
        check_wire(chunk.wire, self._sizes, request.nbytes)
        ticket = self.admission.admit(chunk.room, chunk.generation, chunk.wire.regions, chunk.wire.runs)
        try:
            scatter_chunk(
                chunk.wire,
                self.area.slot(request.slot, request.nbytes),
                {r: self._regions[r] for r in chunk.wire.regions},
            )
        finally:
            self.admission.release(ticket)
        self.landed(request.nbytes)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as err:
                log.warning("staging receiver %s: accept failed: %s", self.address, err)
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
            connection = _Connection(self, sock, where)
            thread = threading.Thread(
                target=self._serve, args=(connection, loop), daemon=True, name=f"pdt-staging-{peer[1]}"
            )
            self._connections[connection] = thread
            if self.auth is not None:
                arm_deadline(loop, connection, self.handshake_timeout_s)
            thread.start()

    def _serve(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        try:
            connection.serve()
        finally:
            if connection.holds_slot:
                with self._stats_lock:
                    self._authenticated -= 1
            try:
                loop.call_soon_threadsafe(self._connections.pop, connection, None)
            except RuntimeError:
                pass  # the loop is gone


class _Connection(GatedConnection):
    """One prefill peer's control connection (its own thread)."""

    def __init__(self, receiver: StagingReceiver, sock: socket.socket, where: str) -> None:
        super().__init__(sock, where, pending=receiver.auth is not None)
        self.receiver = receiver
        self.ring: tuple[int, ...] = ()
        self._failed: set[int] = set()  # transfers refused: their later chunks are too

    def serve(self) -> None:
        receiver = self.receiver
        try:
            if receiver.auth is not None and not self._authenticate():
                self.settle(ok=False)
                return
            while (
                head := read_prefix(self.sock, max_header_nbytes=MAX_HEADER_NBYTES, max_payload_nbytes=0)
            ) is not None:
                header = recv_exact(self.sock, head.header_nbytes)
                if head.kind is not Kind.DATA:
                    receiver.bad_frame(
                        Reason.BAD_FRAME, f"a {head.kind.name.lower()} frame is not accepted here", self.where
                    )
                    return
                self._request(header)
        except TransportError as err:  # a prefix that is not ours: the stream is lost
            receiver.bad_frame(err.code, err.message, self.where)
        except (PeerClosed, OSError) as err:
            log.info("staging receiver %s: %s: %s", receiver.address, self.where, err)
        except Exception:  # never let a bug of ours kill the thread silently
            log.exception("staging receiver %s: %s: request failed", receiver.address, self.where)
            receiver.count(Reason.TRANSPORT_FAILED)
        finally:
            receiver.area.give_back(self.ring)
            self.ring = ()
            self.shutdown()
            self.sock.close()

    def _authenticate(self) -> bool:
        receiver = self.receiver
        self.sock.settimeout(receiver.handshake_timeout_s)  # the gate's deadline cuts in earlier
        try:
            head = read_prefix(self.sock, max_header_nbytes=MAX_HANDSHAKE_NBYTES, max_payload_nbytes=0)
            if head is None:  # closed: by the peer, or cut off by the gate
                raise PeerClosed(partial=False)
            first = recv_exact(self.sock, head.header_nbytes)
            if head.kind is not Kind.HANDSHAKE:
                receiver.bad_frame(
                    Reason.UNAUTHENTICATED, "a request before the authentication handshake", self.where
                )
                receiver.auth.unauthenticated(f"{receiver.address}: {self.where}")
                self._reply(
                    encode_reply(
                        Fail(-1, Reason.UNAUTHENTICATED.value, "this staging channel requires authentication")
                    )
                )
                return False
            receiver.auth.server(first, FrameChannel(self.sock), f"{receiver.address}: {self.where}")
        except TransportError as err:
            if err.code in STREAM_ERRORS:  # garbage, not a refused handshake (counted there)
                receiver.bad_frame(err.code, err.message, self.where)
            else:
                receiver.count(err.code)
            return False
        except OSError as err:  # PeerClosed too: a cut-off shuts the socket down
            if self.cut_off is not None:
                receiver.bad_frame(*self.cut_off, self.where)
            elif isinstance(err, TimeoutError):
                receiver.bad_frame(
                    Reason.TIMEOUT,
                    f"no authentication handshake within {receiver.handshake_timeout_s:g} s",
                    self.where,
                )
            else:
                raise
            return False
        self.sock.settimeout(None)
        if not self.settle():
            return False  # cut off just as it finished
        return receiver.admit_authenticated(self)

    def _request(self, raw: bytes) -> None:
        receiver = self.receiver
        try:
            request = decode_request(raw)
        except TransportError as err:  # answered all the same: one answer per request
            receiver.count(err.code)
            self._reply(encode_reply(Fail(-1, err.code.value, err.message)))
            return
        if isinstance(request, OpenRing):
            if not self.ring:
                self.ring = receiver.area.lease(request.slots)
            self._reply(encode_staging(Ring(self.ring, receiver.area.slot_nbytes)))
            return
        xfer = request.chunk.xfer
        try:
            if xfer in self._failed:
                raise TransportError("the rest of a refused transfer", code=Reason.TRANSPORT_FAILED)
            receiver.scatter(self.ring, request)
        except TransportError as err:
            log.warning(
                "staging receiver %s: refused room %s from %s: %s",
                receiver.address,
                request.chunk.room or "-",
                self.where,
                err.message,
            )
            receiver.count(err.code)
            self._failed.add(xfer)
            if len(self._failed) > 1024:
                self._failed = {xfer}
            self._reply(encode_reply(Fail(xfer, err.code.value, err.message)))
            return
        self._reply(encode_reply(Ack(xfer, request.chunk.seq, request.nbytes)))

    def _reply(self, header: bytes) -> None:
        send_frame(self.sock, Kind.REPLY, header)
