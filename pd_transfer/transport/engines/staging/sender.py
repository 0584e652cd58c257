"""Staged engine writes, prefill side: gather into a slot, one bulk write, decode scatters.

For plans of many small runs an engine pays per descriptor (Mooncake's tcp
path ~80 us each; 65,536 runs of 2 KiB take seconds). Staging moves them as
few large descriptors instead::

    prefill                                          decode
    gather runs -> local slot i  (numpy)
    engine: local slot i -> remote slot ring[i]  (one descriptor; posted, then
            waited for, while the next slots are gathered and posted)
    "staged": slot ring[i] holds these runs  ---->   check every run against the
                                                     registered regions, scatter
                                        <----  ack   (or fail: nothing scattered)

A :class:`StagingChannel` is one authenticated control connection to the
decode rank's :class:`~pd_transfer.transport.engines.staging.receiver.StagingReceiver`
and a ring of slots granted by it (4 x 4 MiB by default), mirrored by a local
buffer registered with this side's engine. Flow control: the chunk for ring
slot ``i`` is written only once the previous chunk in that slot was
answered; answers come in order, one per chunk, so a ring of ``R`` slots
keeps at most ``R`` chunks in flight (being written, or announced and being
scattered) and memory is bounded on both sides. While decode scatters chunk
``k``, prefill gathers and writes chunk ``k+1``.

:func:`write_staged` returns only when decode acknowledged every chunk (every
byte landed). A refused chunk fails the write with decode's reason; the
answers to chunks already sent are still read, so the ring and the stream stay
in step and the link stays usable. A control connection that breaks or
times out fails the link (:class:`~pd_transfer.transport.engines.link.EngineLink`: ``peer_lost`` or
``timeout``).

The probe behind the strategy choice, which uses such a channel, is
:mod:`~pd_transfer.transport.engines.probe`. Blocking calls throughout: run in a worker thread.
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.packing import ChunkLayout, WireRuns, gather_chunk
from pd_transfer.transport.engines.staging.channel_requests import OpenRing, Staged, decode_ring, encode
from pd_transfer.transport.regions import Mapped
from pd_transfer.transport.tcp.frames import Ack, ChunkHeader, Fail, decode_reply
from pd_transfer.transport.tcp.sockets import (
    Authenticator,
    FrameChannel,
    Kind,
    PeerClosed,
    configure,
    parse_address,
    read_prefix,
    recv_exact,
    send_frame,
    shutdown,
)

log = logging.getLogger(__name__)

DEFAULT_RING_SLOTS = 4
Submit = Callable[[list[int], list[int], list[int]], None]  # engine write; raises TransportError
# (local address, remote address, nbytes) -> None once the write is done, or a callable
# that waits for it (an engine that posts asynchronously); either raises the engine's error
Bulk = Callable[[int, int, int], "Callable[[], None] | None"]


@dataclass
class StagingChannel:
    """A control connection and the ring of decode staging slots it was granted."""

    sock: socket.socket
    peer_id: str
    slots: tuple[int, ...]  # decode slot index of ring position i
    slot_nbytes: int
    remote_base: int  # address of decode's staging area (slot 0)
    local: np.ndarray  # our mirror: len(slots) * slot_nbytes, engine-registered
    timeout_s: float
    broken: TransportError | None = None
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def local_base(self) -> int:
        return int(self.local.ctypes.data)

    def local_addr(self, i: int) -> int:
        return self.local_base + i * self.slot_nbytes

    def remote_addr(self, i: int) -> int:
        return self.remote_base + self.slots[i] * self.slot_nbytes

    def close(self) -> None:
        shutdown(self.sock)
        self.sock.close()

    # -- frames ----------------------------------------------------------------------
    def empty_round_trip(self) -> None:
        """Send an empty staged chunk and read decode's answer (the probe's round trip)."""
        xfer = next(self._ids)
        empty = WireRuns((), np.zeros((0, 3), np.int64))
        self.send(Staged(self.slots[0], 0, ChunkHeader(xfer, "", 0, 0, empty)))
        error = self.answer(xfer, 0)
        if error is not None:
            raise error

    def send(self, message: Staged) -> None:
        try:
            send_frame(self.sock, Kind.DATA, encode(message))
        except OSError as err:
            raise self._break(f"sending a staged chunk failed: {err}", Reason.PEER_LOST) from None

    def answer(self, xfer: int, seq: int) -> TransportError | None:
        """Read the answer to chunk ``(xfer, seq)``: None (acked), or decode's refusal."""
        try:
            head = read_prefix(self.sock, max_header_nbytes=1 << 16, max_payload_nbytes=0)
            if head is None:
                raise PeerClosed(partial=False)
            reply = decode_reply(recv_exact(self.sock, head.header_nbytes))
        except TimeoutError:
            raise self._break(f"no answer to a staged chunk in {self.timeout_s} s", Reason.TIMEOUT) from None
        except TransportError as err:
            raise self._break(f"unreadable answer: {err.message}", Reason.TRANSPORT_FAILED) from None
        except OSError as err:  # PeerClosed is a ConnectionError
            raise self._break(f"the connection ended: {err}", Reason.PEER_LOST) from None
        if head.kind is not Kind.REPLY:
            raise self._break(
                f"a {head.kind.name.lower()} frame where an answer was expected", Reason.TRANSPORT_FAILED
            )
        if isinstance(reply, Fail) and reply.xfer in (xfer, -1):
            return TransportError(f"{self.peer_id} refused a staged chunk: {reply.text}", code=reply.reason())
        if isinstance(reply, Ack) and (reply.xfer, reply.seq) == (xfer, seq):
            return None
        raise self._break(
            f"answer {reply!r} does not match chunk {seq} of transfer {xfer}", Reason.TRANSPORT_FAILED
        )

    def _break(self, what: str, code: Reason) -> TransportError:
        self.broken = TransportError(
            f"staging channel to {self.peer_id}: {what}",
            code=code,
            hint="the peer must register again (a new link)",
        )
        return self.broken


def open_channel(
    address: str,
    staging: tuple[int, int, int],
    peer_id: str,
    *,
    auth: Authenticator | None = None,
    ring_slots: int = DEFAULT_RING_SLOTS,
    timeout_s: float = 60.0,
    connect_timeout_s: float = 10.0,
    handshake_timeout_s: float = 10.0,
) -> StagingChannel | None:
    """Connect, authenticate, ask for a ring; None when decode has no slot free.

    ``staging`` is what decode published: ``(address, nbytes, slot_nbytes)``
    of its staging area. Raises TransportError when decode cannot be reached
    or refuses the handshake.
    """
    area_addr, area_nbytes, _ = staging
    try:
        sock = socket.create_connection(parse_address(address), timeout=connect_timeout_s)
    except OSError as err:
        raise TransportError(
            f"cannot reach the staging channel of {peer_id} at {address}: {err}", code=Reason.TRANSPORT_FAILED
        ) from None
    try:
        configure(sock)
        if auth is not None:
            sock.settimeout(handshake_timeout_s)
            auth.client(FrameChannel(sock), f"{peer_id} staging ({address})")
        sock.settimeout(timeout_s)
        send_frame(sock, Kind.DATA, encode(OpenRing(ring_slots)))
        head = read_prefix(sock, max_header_nbytes=1 << 16, max_payload_nbytes=0)
        if head is None or head.kind is not Kind.REPLY:
            raise TransportError(
                f"staging channel of {peer_id} did not grant a ring", code=Reason.TRANSPORT_FAILED
            )
        ring = _ring_or_refusal(recv_exact(sock, head.header_nbytes), peer_id)
    except (OSError, TransportError) as err:
        sock.close()
        if isinstance(err, TransportError):
            raise
        raise TransportError(
            f"staging channel of {peer_id} at {address}: {err}", code=Reason.TRANSPORT_FAILED
        ) from None
    if not ring.slots:
        sock.close()
        return None
    if (max(ring.slots) + 1) * ring.slot_nbytes > area_nbytes:
        sock.close()
        raise TransportError(
            f"{peer_id} granted staging slots {list(ring.slots)} of "
            f"{ring.slot_nbytes} bytes outside its published area of "
            f"{area_nbytes} bytes",
            code=Reason.BAD_FIELD,
        )
    local = np.zeros(len(ring.slots) * ring.slot_nbytes, np.uint8)
    return StagingChannel(sock, peer_id, ring.slots, ring.slot_nbytes, area_addr, local, timeout_s)


def _ring_or_refusal(frame: bytes, peer_id: str):
    try:
        return decode_ring(frame)
    except TransportError as err:
        try:
            reply = decode_reply(frame)
        except TransportError:
            raise err from None
        if isinstance(reply, Fail):
            raise TransportError(
                f"staging channel of {peer_id} refused us: {reply.text}", code=reply.reason()
            ) from None
        raise


@dataclass
class _Flight:
    """A slot's bulk write, posted and not yet announced to decode."""

    wait: Callable[[], None] | None
    slot: int
    layout: ChunkLayout


def write_staged(
    channel: StagingChannel,
    layouts: list[ChunkLayout],
    src: Mapping[str, Mapped],
    bulk: Bulk,
    *,
    room: str = "",
    generation: int = 0,
) -> int:
    """Gather, bulk-write and have decode scatter every chunk; return the bytes acked.

    An engine that posts writes asynchronously (``bulk`` returns a waiter)
    keeps several slots' writes in flight while the next slot is gathered:
    over UCX tcp a 4 MiB write costs a few milliseconds before its first byte
    moves, which writes in flight hide. Each chunk is announced to decode, in
    order, only once its write has finished.

    Raises the first refusal (after reading every answer still due), the
    engine's error from ``bulk``, or the channel's break.
    """
    if channel.broken is not None:
        raise channel.broken
    write = _StagedWrite(channel, room, generation)
    try:
        write.post(layouts, src, bulk)
    finally:
        write.finish()
    if write.refused is not None:
        raise write.refused
    return write.acked


class _StagedWrite:
    """One :func:`write_staged` call: writes posted, chunks announced, answers read."""

    def __init__(self, channel: StagingChannel, room: str, generation: int) -> None:
        self.channel = channel
        self.room = room
        self.generation = generation
        self.xfer = next(channel._ids)
        self.ring = len(channel.slots)
        self.flights: deque[_Flight] = deque()  # posted, not announced
        self.pending: deque[tuple[int, int]] = deque()  # (seq, nbytes) announced, not answered
        self.refused: TransportError | None = None
        self.acked = 0

    def land(self) -> None:
        """The oldest write finished: announce it."""
        flight = self.flights.popleft()
        if flight.wait is not None:
            flight.wait()
        layout = flight.layout
        self.channel.send(
            Staged(
                self.channel.slots[flight.slot],
                layout.nbytes,
                ChunkHeader(self.xfer, self.room, self.generation, layout.seq, layout.wire),
            )
        )
        self.pending.append((layout.seq, layout.nbytes))

    def settle(self) -> None:
        """Read decode's answer to the oldest announced chunk."""
        self.refused, self.acked = _settle(self.channel, self.xfer, self.pending, self.refused, self.acked)

    def post(self, layouts: list[ChunkLayout], src: Mapping[str, Mapped], bulk: Bulk) -> None:
        """Gather each chunk into its slot, post its write, announce the writes that ended."""
        channel, ring, flights = self.channel, self.ring, self.flights
        for layout in layouts:
            i = layout.seq % ring
            while any(f.slot == i for f in flights):  # local slot i: its write must be done
                self.land()
            out = channel.local[i * channel.slot_nbytes : (i + 1) * channel.slot_nbytes]
            gather_chunk(layout, src, out=out)
            while len(flights) + len(self.pending) >= ring:  # remote slot i is free once answered
                if self.pending:
                    self.settle()
                else:
                    self.land()
            if self.refused is not None:
                break
            flights.append(
                _Flight(bulk(channel.local_addr(i), channel.remote_addr(i), layout.nbytes), i, layout)
            )
            # a write already done is announced at once; of posted ones, at most half the
            # ring stays in flight (the other slots: chunks decode is scattering)
            while flights and (flights[0].wait is None or len(flights) > max(1, ring // 2)):
                self.land()
        while flights and self.refused is None:
            self.land()

    def finish(self) -> None:
        """Let posted writes end (never announced after an error), then read every answer due."""
        for flight in self.flights:  # an error left writes posted: let them end, never announce
            if flight.wait is not None:
                try:
                    flight.wait()
                except TransportError:
                    pass
        self.flights.clear()
        while self.pending and self.channel.broken is None:  # keep the stream in step, even on errors
            self.settle()


def _settle(
    channel: StagingChannel, xfer: int, pending: deque, refused: TransportError | None, acked: int
) -> tuple[TransportError | None, int]:
    seq, nbytes = pending.popleft()
    error = channel.answer(xfer, seq)
    if error is None:
        return refused, acked + nbytes
    return refused or error, acked
