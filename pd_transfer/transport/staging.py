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
decode rank's :class:`~pd_transfer.transport.staging_receiver.StagingReceiver`
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
times out fails the link (:class:`~.engine_link.EngineLink`: ``peer_lost`` or
``timeout``).

:func:`measure_path` is the short probe behind the strategy choice
(:mod:`.strategy`): a few engine submissions into our own remote slot (decode
scatters nothing it was not told about), a numpy gather, and an empty staged
round trip. Blocking calls throughout: run in a worker thread.
"""

from __future__ import annotations

import functools
import itertools
import logging
import mmap
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.frames import Ack, ChunkHeader, Fail, decode_reply
from pd_transfer.transport.packing import ChunkLayout, WireRuns, gather_chunk, gather_pieces
from pd_transfer.transport.regions import Mapped
from pd_transfer.transport.sockets import (
    Authenticator,
    FrameChannel,
    Kind,
    PeerClosed,
    configure,
    parse_address,
    read_prefix,
    recv_exact,
    send_frame,
)
from pd_transfer.transport.staging_wire import OpenRing, Staged, decode_ring, encode
from pd_transfer.transport.strategy import PathCost

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
    slots: tuple[int, ...]          # decode slot index of ring position i
    slot_nbytes: int
    remote_base: int                # address of decode's staging area (slot 0)
    local: np.ndarray               # our mirror: len(slots) * slot_nbytes, engine-registered
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
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    # -- frames ----------------------------------------------------------------------
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
            raise self._break(f"no answer to a staged chunk in {self.timeout_s} s",
                              Reason.TIMEOUT) from None
        except TransportError as err:
            raise self._break(f"unreadable answer: {err.message}", Reason.TRANSPORT_FAILED) from None
        except OSError as err:  # PeerClosed is a ConnectionError
            raise self._break(f"the connection ended: {err}", Reason.PEER_LOST) from None
        if head.kind is not Kind.REPLY:
            raise self._break(f"a {head.kind.name.lower()} frame where an answer was expected",
                              Reason.TRANSPORT_FAILED)
        if isinstance(reply, Fail) and reply.xfer in (xfer, -1):
            return TransportError(f"{self.peer_id} refused a staged chunk: {reply.text}",
                                  code=reply.reason())
        if isinstance(reply, Ack) and (reply.xfer, reply.seq) == (xfer, seq):
            return None
        raise self._break(f"answer {reply!r} does not match chunk {seq} of transfer {xfer}",
                          Reason.TRANSPORT_FAILED)

    def _break(self, what: str, code: Reason) -> TransportError:
        self.broken = TransportError(f"staging channel to {self.peer_id}: {what}", code=code,
                                     hint="the peer must register again (a new link)")
        return self.broken


def open_channel(address: str, staging: tuple[int, int, int], peer_id: str, *,
                 auth: Authenticator | None = None, ring_slots: int = DEFAULT_RING_SLOTS,
                 timeout_s: float = 60.0, connect_timeout_s: float = 10.0,
                 handshake_timeout_s: float = 10.0) -> StagingChannel | None:
    """Connect, authenticate, ask for a ring; None when decode has no slot free.

    ``staging`` is what decode published: ``(address, nbytes, slot_nbytes)``
    of its staging area. Raises TransportError when decode cannot be reached
    or refuses the handshake.
    """
    area_addr, area_nbytes, _ = staging
    try:
        sock = socket.create_connection(parse_address(address), timeout=connect_timeout_s)
    except OSError as err:
        raise TransportError(f"cannot reach the staging channel of {peer_id} at {address}: "
                             f"{err}", code=Reason.TRANSPORT_FAILED) from None
    try:
        configure(sock)
        if auth is not None:
            sock.settimeout(handshake_timeout_s)
            auth.client(FrameChannel(sock), f"{peer_id} staging ({address})")
        sock.settimeout(timeout_s)
        send_frame(sock, Kind.DATA, encode(OpenRing(ring_slots)))
        head = read_prefix(sock, max_header_nbytes=1 << 16, max_payload_nbytes=0)
        if head is None or head.kind is not Kind.REPLY:
            raise TransportError(f"staging channel of {peer_id} did not grant a ring",
                                 code=Reason.TRANSPORT_FAILED)
        ring = _ring_or_refusal(recv_exact(sock, head.header_nbytes), peer_id)
    except (OSError, TransportError) as err:
        sock.close()
        if isinstance(err, TransportError):
            raise
        raise TransportError(f"staging channel of {peer_id} at {address}: {err}",
                             code=Reason.TRANSPORT_FAILED) from None
    if not ring.slots:
        sock.close()
        return None
    if (max(ring.slots) + 1) * ring.slot_nbytes > area_nbytes:
        sock.close()
        raise TransportError(f"{peer_id} granted staging slots {list(ring.slots)} of "
                             f"{ring.slot_nbytes} bytes outside its published area of "
                             f"{area_nbytes} bytes", code=Reason.BAD_FIELD)
    local = np.zeros(len(ring.slots) * ring.slot_nbytes, np.uint8)
    return StagingChannel(sock, peer_id, ring.slots, ring.slot_nbytes, area_addr, local,
                          timeout_s)


def _ring_or_refusal(frame: bytes, peer_id: str):
    try:
        return decode_ring(frame)
    except TransportError as err:
        try:
            reply = decode_reply(frame)
        except TransportError:
            raise err from None
        if isinstance(reply, Fail):
            raise TransportError(f"staging channel of {peer_id} refused us: {reply.text}",
                                 code=reply.reason()) from None
        raise


@dataclass
class _Flight:
    """A slot's bulk write, posted and not yet announced to decode."""

    wait: Callable[[], None] | None
    slot: int
    layout: ChunkLayout


def write_staged(channel: StagingChannel, layouts: list[ChunkLayout], src: Mapping[str, Mapped],
                 bulk: Bulk, *, room: str = "", generation: int = 0) -> int:
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
    xfer = next(channel._ids)
    ring = len(channel.slots)
    flights: deque[_Flight] = deque()           # posted, not announced
    pending: deque[tuple[int, int]] = deque()   # (seq, nbytes) announced, not answered
    refused: TransportError | None = None
    acked = 0

    def land() -> None:  # the oldest write finished: announce it
        flight = flights.popleft()
        if flight.wait is not None:
            flight.wait()
        layout = flight.layout
        channel.send(Staged(channel.slots[flight.slot], layout.nbytes,
                            ChunkHeader(xfer, room, generation, layout.seq, layout.wire)))
        pending.append((layout.seq, layout.nbytes))

    try:
        for layout in layouts:
            i = layout.seq % ring
            while any(f.slot == i for f in flights):  # local slot i: its write must be done
                land()
            out = channel.local[i * channel.slot_nbytes:(i + 1) * channel.slot_nbytes]
            gather_chunk(layout, src, out=out)
            while len(flights) + len(pending) >= ring:  # remote slot i is free once answered
                if pending:
                    refused, acked = _settle(channel, xfer, pending, refused, acked)
                else:
                    land()
            if refused is not None:
                break
            flights.append(_Flight(bulk(channel.local_addr(i), channel.remote_addr(i),
                                        layout.nbytes), i, layout))
            # a write already done is announced at once; of posted ones, at most half the
            # ring stays in flight (the other slots: chunks decode is scattering)
            while flights and (flights[0].wait is None or len(flights) > max(1, ring // 2)):
                land()
        while flights and refused is None:
            land()
    finally:
        for flight in flights:   # an error left writes posted: let them end, never announce
            if flight.wait is not None:
                try:
                    flight.wait()
                except TransportError:
                    pass
        flights.clear()
        while pending and channel.broken is None:  # keep the stream in step, even on errors
            refused, acked = _settle(channel, xfer, pending, refused, acked)
    if refused is not None:
        raise refused
    return acked


def _settle(channel: StagingChannel, xfer: int, pending: deque, refused: TransportError | None,
            acked: int) -> tuple[TransportError | None, int]:
    seq, nbytes = pending.popleft()
    error = channel.answer(xfer, seq)
    if error is None:
        return refused, acked + nbytes
    return refused or error, acked


# -- the probe --------------------------------------------------------------------------------
_TINY_NBYTES = 64
_RUN_NBYTES = 4096
_MAX_PROBE_RUNS = 256
_COPY_SOURCE_NBYTES = 48 << 20    # 12 windows of 4 MiB, larger than most last-level caches
_COPY_NBYTES = 4 << 20
_WARM_NBYTES = 512 << 10
_GATHER_RUN_NBYTES = 2048
_LARGE_RUN_NBYTES = 64 << 10


def measure_path(channel: StagingChannel, submit: Submit, *, repeats: int = 5) -> PathCost:
    """Time the engine path to our own remote slots, a local gather and a round trip.

    Tens of milliseconds, once per link: one tiny descriptor (the fixed
    cost); the cost of each further descriptor, measured two ways (below);
    every ring slot written whole, one descriptor each, as staged writes go
    (the bulk bandwidth); an empty staged chunk (the round trip). Minimum of
    ``repeats`` each (of 2 for the whole ring): links probe while their
    sidecars start, all at once, and one sample in two came out several
    times too slow on a busy 2-core host. Decode scatters nothing of it: it
    was not told about any run.

    A descriptor's cost is the larger of: 256 tiny descriptors in one
    submission against one (their 16 KiB take no time worth counting), and
    256 runs of 4 KiB against one run of the same 1 MiB (what a run of a few
    KiB costs beyond its bytes). Each alone misled on one engine. Over
    Mooncake tcp (0.2 GB/s here) the second is a small difference of two
    times that both carry the bandwidth, and it came out at 0 on one link in
    eight, which sent 512-byte head slices direct at 7 s a request. Over NIXL
    UCX the first is 0.5-1 us, while a 2 KiB run costs several times that.
    """
    local, remote = channel.local_addr(0), channel.remote_addr(0)
    one = _best(repeats, lambda: submit([local], [remote], [_TINY_NBYTES]))
    per_descriptor = max(_descriptor_cost(channel, submit, run_nbytes, repeats, one)
                         for run_nbytes in (_TINY_NBYTES, _RUN_NBYTES))
    ring = range(len(channel.slots))
    bulk = _best(min(repeats, 2), lambda: [submit([channel.local_addr(i)],
                                                  [channel.remote_addr(i)],
                                                  [channel.slot_nbytes]) for i in ring])
    bulk_nbytes = len(ring) * channel.slot_nbytes
    copy_bps, per_run = copy_cost()
    round_trip = _best(repeats, lambda: _empty_round_trip(channel))
    return PathCost(fixed_s=one, per_descriptor_s=per_descriptor,
                    engine_bytes_per_s=bulk_nbytes / max(bulk - len(ring) * one, bulk / 2, 1e-6),
                    copy_bytes_per_s=copy_bps, copy_per_run_s=per_run, round_trip_s=round_trip)


def _descriptor_cost(channel: StagingChannel, submit: Submit, run_nbytes: int, repeats: int,
                     one_tiny_s: float) -> float:
    """Seconds each further descriptor of ``run_nbytes`` adds to a submission: many such
    runs against their bytes as one run (tiny runs: against one tiny descriptor)."""
    local, remote = channel.local_addr(0), channel.remote_addr(0)
    num = max(2, min(_MAX_PROBE_RUNS, channel.slot_nbytes // (2 * run_nbytes)))
    offsets = [k * 2 * run_nbytes for k in range(num)]   # every other run: nothing joins
    many = _best(repeats, lambda: submit([local + o for o in offsets],
                                         [remote + o for o in offsets], [run_nbytes] * num))
    same = one_tiny_s if run_nbytes == _TINY_NBYTES else \
        _best(repeats, lambda: submit([local], [remote], [num * run_nbytes]))
    return max(many - same, 0.0) / (num - 1)


def _best(repeats: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def copy_cost() -> tuple[float, float]:
    """This host's gather bandwidth (bytes/s) and the extra cost of one gathered run (s).

    Measured once per process. Bandwidth: 4 MiB gathered as 64 runs of 64 KiB
    from shared memory larger than the caches (KV pools are shared memory, in
    4 KiB pages), each time from a part not read before. Per run: 512 KiB
    gathered as 256 runs of 2 KiB and as 8 of 64 KiB from one part read again
    and again, the difference over the difference in runs: the work numpy does
    per run. A run's cache and TLB misses are left out on purpose: an engine
    moving the same run direct pays them too, and with them the figure swung
    from 20 to 400 ns between processes started together on a busy host
    (warm: 43-55 ns), enough to flip the choice for 512-byte head slices.
    """
    with mmap.mmap(-1, _COPY_SOURCE_NBYTES) as shared:
        source = np.frombuffer(shared, np.uint8)
        source[:] = 1
        out = np.empty(_COPY_NBYTES, np.uint8)
        large = _gather_time(source, out, _LARGE_RUN_NBYTES, windows=(2, 6, 10))
        warm = out[:_WARM_NBYTES]
        small_warm = _gather_time(source, warm, _GATHER_RUN_NBYTES, windows=(0,) * 5)
        large_warm = _gather_time(source, warm, _LARGE_RUN_NBYTES, windows=(0,) * 5)
        del source
    num_small, num_large = _WARM_NBYTES // _GATHER_RUN_NBYTES, _WARM_NBYTES // _LARGE_RUN_NBYTES
    per_run = max(small_warm - large_warm, 0.0) / (num_small - num_large)
    copy_bps = _COPY_NBYTES / max(large - _COPY_NBYTES // _LARGE_RUN_NBYTES * per_run, 1e-6)
    return copy_bps, per_run


def _gather_time(source: np.ndarray, out: np.ndarray, run_nbytes: int, windows) -> float:
    """Best time to gather ``out`` as runs of ``run_nbytes``: every other run of two
    windows of ``out``'s size, in random order."""
    region = Mapped("probe", source)
    num = out.size // run_nbytes
    sizes = np.full(num, run_nbytes, np.int64)
    rng = np.random.default_rng(0)
    best = float("inf")
    for window in windows:
        offset = window * out.size + rng.permutation(num).astype(np.int64) * 2 * run_nbytes
        start = time.perf_counter()
        gather_pieces(region, offset, sizes, out)
        best = min(best, time.perf_counter() - start)
    return best


def _empty_round_trip(channel: StagingChannel) -> None:
    xfer = next(channel._ids)
    empty = WireRuns((), np.zeros((0, 3), np.int64))
    channel.send(Staged(channel.slots[0], 0, ChunkHeader(xfer, "", 0, 0, empty)))
    error = channel.answer(xfer, 0)
    if error is not None:
        raise error
