"""One connection accepted by a :class:`~pd_transfer.transport.tcp.receiver.TcpReceiver`, served by its own thread.

Order of events for each chunk frame (nothing is written before the last check):

1. the prefix (:func:`~pd_transfer.transport.tcp.sockets.read_prefix`) and the msgpack header are read
   and decoded (:mod:`~pd_transfer.transport.tcp.frames`): a bad one is refused and its payload skipped;
2. every run is checked against the registered regions
   (:func:`~pd_transfer.transport.copy.packing.check_wire`), then the room (:class:`~pd_transfer.transport.receiver_rooms.ReceiverRooms`:
   fence, expected room and generation, the room's own pages), which marks
   the chunk as landing;
3. the payload is received straight into the destination pages
   (``recvmsg_into`` over :func:`~pd_transfer.transport.tcp.iovecs.destination_views`), short runs
   through a staging buffer; then the chunk is acked.

A refused chunk fails its transfer (the sender's ``write`` raises with the
reason) and later frames of that transfer are dropped, counted; the
connection goes on serving other transfers. A frame whose prefix is not ours,
or a peer that fails the handshake, closes the connection.

Before authentication a connection is a stranger's: its first frame may
declare at most :data:`~pd_transfer.transport.tcp.sockets.MAX_HANDSHAKE_NBYTES` of header (a data frame
sent first is refused unread beyond that), and the whole handshake has one
deadline (:mod:`~pd_transfer.transport.tcp.handshake_gate`). Frames
declaring more than the limits are refused by their prefix, before a byte of
them is buffered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
from collections.abc import Callable
from typing import Any

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory import segment_guard as shm_guard
from pd_transfer.transport.copy.packing import check_wire, scatter_chunk
from pd_transfer.transport.receiver_rooms import Ticket
from pd_transfer.transport.tcp.frames import (
    MAX_HEADER_NBYTES,
    Ack,
    ChunkHeader,
    EndHeader,
    Fail,
    XferDone,
    decode_data,
    encode,
)
from pd_transfer.transport.tcp.handshake_gate import GatedConnection
from pd_transfer.transport.tcp.iovecs import Staging, destination_parts, finish
from pd_transfer.transport.tcp.sockets import (
    MAX_HANDSHAKE_NBYTES,
    Kind,
    discard,
    read_prefix,
    recv_all_into,
    recv_exact,
    recv_part,
    send_frame,
)
from pd_transfer.transport.tcp.xfers import Incoming, check_complete

log = logging.getLogger("pd_transfer.transport.tcp.transport")

_ON_LANDED_TIMEOUT_S = 30.0


class Connection(GatedConnection):
    """Serves one peer connection; :meth:`serve` is the thread's body."""

    def __init__(self, receiver: Any, sock: socket.socket, where: str) -> None:  # a TcpReceiver
        super().__init__(sock, where, pending=receiver.auth is not None)
        self.receiver = receiver
        self.landing: Ticket | None = None  # the chunk being received (for fences)
        self._xfers = Incoming(log)
        self._staging = Staging()

    def _frames(self) -> None:
        receiver = self.receiver
        while (head := self._prefix()) is not None:
            header = recv_exact(self.sock, head.header_nbytes)
            if head.kind is Kind.DATA:
                self._frame(header, head.payload_nbytes)
                continue
            discard(self.sock, head.payload_nbytes)
            why = f"a {head.kind.name.lower()} frame is not accepted here" + (
                "" if receiver.auth else ": this receiver runs no authentication handshake"
            )
            receiver.bad_frame(Reason.BAD_FRAME, why, self.where)
            self._reply(Fail(-1, Reason.BAD_FRAME.value, why))
            if head.kind is Kind.HANDSHAKE:
                return

    def _prefix(self):
        return read_prefix(
            self.sock, max_header_nbytes=MAX_HEADER_NBYTES, max_payload_nbytes=self.receiver.max_chunk_nbytes
        )

    # -- authentication ------------------------------------------------------------------
    def _handshake_head(self):
        return self._prefix()  # the handshake's own limits are checked on its prefix

    def _refuse_unauthenticated(self, head) -> None:
        """A data frame before the handshake: refused, its header read only if it is as
        small as a handshake frame (to name the transfer in the refusal)."""
        receiver = self.receiver
        receiver.bad_frame(Reason.UNAUTHENTICATED, "", self.where, logged=False)
        if receiver.auth is not None:  # (a connection is pending only where it is)
            receiver.auth.unauthenticated(f"{receiver.address}: {self.where}")
        xfer = -1
        if head.kind is Kind.DATA and head.header_nbytes <= MAX_HANDSHAKE_NBYTES:
            try:
                xfer = decode_data(recv_exact(self.sock, head.header_nbytes)).xfer
            except TransportError:
                pass
        self._reply(
            Fail(
                xfer,
                Reason.UNAUTHENTICATED.value,
                "this receiver requires authentication: the connection sent data before the handshake",
            )
        )

    # -- frames ----------------------------------------------------------------------------
    def _frame(self, raw: bytes, payload_nbytes: int) -> None:
        receiver = self.receiver
        try:
            header = decode_data(raw)
        except TransportError as err:  # no transfer to answer: counted only
            receiver.bad_frame(err.code, err.message, self.where)
            discard(self.sock, payload_nbytes)
            return
        if self._xfers.refused(None, header.xfer):
            receiver.count(Reason.TRANSPORT_FAILED)  # the rest of a refused transfer
            discard(self.sock, payload_nbytes)
            return
        try:
            if isinstance(header, ChunkHeader):
                self._chunk(header, payload_nbytes)
            else:
                if payload_nbytes:
                    discard(self.sock, payload_nbytes)
                    raise TransportError("an end frame carries no payload", code=Reason.BAD_FRAME)
                self._end(header)
        except TransportError as err:
            self._refuse(header.xfer, header.room, err)

    def _chunk(self, header: ChunkHeader, payload_nbytes: int) -> None:
        receiver = self.receiver
        try:
            regions = {region_id: receiver.region(region_id) for region_id in header.wire.regions}
            check_wire(header.wire, {r: m.nbytes for r, m in regions.items()}, payload_nbytes)
            ticket = receiver.admission.admit(
                header.room, header.generation, header.wire.regions, header.wire.runs
            )
        except TransportError:
            discard(self.sock, payload_nbytes)  # nothing of it is written
            raise
        progress = self._xfers.progress(None, header.xfer, f"tcp receiver {receiver.address}")
        self.landing = ticket
        before = shm_guard.faults_total()
        try:
            self._land(header, regions, payload_nbytes)
            shm_guard.check_landed(before, f"room {header.room} chunk {header.seq}")
        finally:
            self.landing = None
            receiver.admission.release(ticket)
        progress.chunks += 1
        progress.nbytes += payload_nbytes
        receiver.landed(payload_nbytes)
        self._reply(Ack(header.xfer, header.seq, payload_nbytes))

    def _land(self, header: ChunkHeader, regions: dict, payload_nbytes: int) -> None:
        if payload_nbytes < self.receiver.inline_nbytes:  # small: one recv, one numpy scatter
            payload = self._staging.take(payload_nbytes)
            recv_all_into(self.sock, [payload.data])
            scatter_chunk(header.wire, payload, regions)
            return
        for part in destination_parts(header.wire, regions, self._staging, self.receiver.direct_min_nbytes):
            recv_part(self.sock, part)
            finish(part)

    def _end(self, header: EndHeader) -> None:
        receiver = self.receiver
        receiver.admission.check_end(header.room, header.generation)
        check_complete(self._xfers.end(None, header.xfer), header)
        receiver.transfer_done()
        if receiver.on_landed is not None and receiver.loop is not None:  # (the loop: once started)
            self._on_landed(header, receiver.on_landed, receiver.loop)
        self._reply(XferDone(header.xfer, header.nbytes))

    def _on_landed(
        self, header: EndHeader, on_landed: Callable[[str, int, int], None], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Run the receiver's callback on its event loop, and wait for it (before ``done``)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                on_landed(header.room, header.generation, header.nbytes)
                done.set_result(None)
            except Exception as err:  # the callback's bug: logged, the transfer still landed
                done.set_exception(err)

        try:
            loop.call_soon_threadsafe(run)
            done.result(_ON_LANDED_TIMEOUT_S)
        except Exception:
            log.exception("tcp receiver %s: on_landed failed", self.receiver.address)

    def _refuse(self, xfer: int, room: str, err: TransportError) -> None:
        log.warning(
            "tcp receiver %s: refused room %s from %s: %s",
            self.receiver.address,
            room or "-",
            self.where,
            err.message,
        )
        self.receiver.count(err.code)
        self._xfers.refuse(None, xfer)
        self._reply(Fail(xfer, err.code.value, err.message))

    def _reply(self, message: Ack | XferDone | Fail) -> None:
        try:
            send_frame(self.sock, Kind.REPLY, encode(message))
        except OSError as err:  # the peer went away; its write fails or times out
            log.info("tcp receiver %s: reply to %s lost: %s", self.receiver.address, self.where, err)
