"""Staged engine writes, decode side: the staging area and the control channel that scatters it.

A decode rank running an engine transport registers, besides its regions, one
:class:`StagingArea` with its engine (default 16 slots of 4 MiB) and
publishes it with its engine address. Prefill writes gathered chunks into
slots of it with the engine and then says, on a control connection served by
:class:`StagingReceiver`, which slot holds which destination runs
(:mod:`~pd_transfer.transport.engines.staging.channel_requests`). For each such request the receiver

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
(both are a :class:`~pd_transfer.transport.tcp.serving.ThreadedReceiver`), the same
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

import logging
import socket
import threading
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.packing import check_wire, scatter_chunk
from pd_transfer.transport.engines.staging.channel_requests import (
    MAX_HEADER_NBYTES,
    OpenRing,
    Ring,
    Staged,
    decode_request,
)
from pd_transfer.transport.engines.staging.channel_requests import encode as encode_staging
from pd_transfer.transport.receiver_rooms import ReceiverRooms
from pd_transfer.transport.regions import Mapped, Regions, map_one
from pd_transfer.transport.tcp.frames import Ack, Fail
from pd_transfer.transport.tcp.frames import encode as encode_reply
from pd_transfer.transport.tcp.handshake_gate import GatedConnection
from pd_transfer.transport.tcp.serving import ThreadedReceiver
from pd_transfer.transport.tcp.sockets import (
    MAX_HANDSHAKE_NBYTES,
    Authenticator,
    Kind,
    read_prefix,
    recv_exact,
    send_frame,
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


class StagingReceiver(ThreadedReceiver):
    """Serve staged-chunk requests for ``regions`` out of ``area`` at ``tcp://bind_host:port``.

    ``admission``: share the room book of the engine receiver this channel
    belongs to (its fences then hold for staged chunks too).
    """

    label: ClassVar[str] = "staging receiver"
    thread_prefix: ClassVar[str] = "pdt-staging"
    task_prefix: ClassVar[str] = "staging"
    log: ClassVar[logging.Logger] = log

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
        admission: ReceiverRooms | None = None,
    ) -> None:
        super().__init__(
            bind_host,
            port,
            auth=auth,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
            max_pending=max_pending,
            on_bad_frame=on_bad_frame,
            admission=admission,
        )
        self.area = area
        self._regions: dict[str, Mapped] = {r: map_one(r, m, "destination") for r, m in regions.items()}
        self._sizes = {r: m.nbytes for r, m in self._regions.items()}

    def _connection(self, sock: socket.socket, where: str) -> _Connection:
        return _Connection(self, sock, where)

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


class _Connection(GatedConnection):
    """One prefill peer's control connection (its own thread)."""

    def __init__(self, receiver: StagingReceiver, sock: socket.socket, where: str) -> None:
        super().__init__(sock, where, pending=receiver.auth is not None)
        self.receiver: StagingReceiver = receiver
        self.ring: tuple[int, ...] = ()
        self._failed: set[int] = set()  # transfers refused: their later chunks are too

    def _frames(self) -> None:
        receiver = self.receiver
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

    def _ended(self) -> None:
        self.receiver.area.give_back(self.ring)
        self.ring = ()

    def _handshake_head(self):
        return read_prefix(self.sock, max_header_nbytes=MAX_HANDSHAKE_NBYTES, max_payload_nbytes=0)

    def _refuse_unauthenticated(self, head) -> None:
        receiver = self.receiver
        recv_exact(self.sock, head.header_nbytes)
        receiver.bad_frame(
            Reason.UNAUTHENTICATED, "a request before the authentication handshake", self.where
        )
        if receiver.auth is not None:  # (a connection is pending only where it is)
            receiver.auth.unauthenticated(f"{receiver.address}: {self.where}")
        self._reply(
            encode_reply(
                Fail(-1, Reason.UNAUTHENTICATED.value, "this staging channel requires authentication")
            )
        )

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
