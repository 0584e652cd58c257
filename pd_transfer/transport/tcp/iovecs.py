"""A chunk's I/O vectors: the memory the kernel reads a payload from, or writes it into.

Sender, :func:`source_parts`: for each stretch of a chunk's source pieces
(:class:`~pd_transfer.transport.copy.packing.ChunkLayout`), pieces that continue each other are joined;
if the stretch's pieces average at least ``direct_min_nbytes`` the kernel
reads them from the source region itself (no copy of ours), otherwise they
are gathered into a staging buffer first (small iovecs cost more than a copy).

Receiver, :func:`destination_parts`: the same rule per stretch of a checked
chunk's runs (:class:`~pd_transfer.transport.copy.packing.WireRuns`) of one region, with a higher
threshold (4 KiB with the native copy loop, against 1 KiB sending: the kernel
writes small scattered runs worse than it reads them): long runs are received in place,
short ones into the staging buffer and then scattered (:func:`finish`).

Both yield the payload in *parts* (:class:`Part`: one ``sendmsg`` or
``recvmsg`` call's iovecs, at most about IOV_MAX), each sent (received)
before the next is built: the staging buffer holds at most ``stage_nbytes``
(2 MiB, so a staged part is still in cache when the kernel copies it) and is
reused by the next part. A part is a few numpy arrays, never one Python object
per run (:mod:`~pd_transfer.transport.tcp.native_io`).

Worked example, 16 MiB chunks of a TP 2 -> 2 plan of 16 KiB page runs: one
part of 1024 iovecs straight from the source pages, one straight into the
decode pages. A TP 2 -> 4 sliced plan has 512-byte source pieces at a 1 KiB
stride: gathered 2 MiB at a time on the sender; at the destination they fill
8 KiB page runs back to back, so the receiver takes them in place.

Pure numpy; no sockets, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.transport.copy import native_loop
from pd_transfer.transport.copy.packing import ChunkLayout, WireRuns, gather_pieces, scatter_pieces
from pd_transfer.transport.regions import Mapped
from pd_transfer.transport.tcp import native_io
from pd_transfer.transport.tcp.native_io import IOV_MAX

# sending, natively an iovec costs the kernel little: 2 KiB pieces went out faster in place
# than gathered; as memoryviews each costs a Python object, and below 4 KiB a copy is cheaper
DIRECT_MIN_NBYTES = 1024 if native_io.AVAILABLE else 4096
# receiving, the kernel's copy into scattered 2 KiB runs reads each destination line before
# writing it; received into the staging buffer and scattered with streaming stores
# (:mod:`~pd_transfer.transport.copy.native_loop`), 65,536 random 2 KiB runs landed 4-13% sooner (2 streams, loopback)
RECEIVE_DIRECT_MIN_NBYTES = 4096 if native_loop.AVAILABLE else DIRECT_MIN_NBYTES
STAGE_NBYTES = 2 << 20


class Staging:
    """A reusable byte buffer (one per connection thread), grown to the largest need."""

    def __init__(self) -> None:
        self.array = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self.array.size < nbytes:
            self.array = np.empty(max(nbytes, 2 * self.array.size), np.uint8)
        return self.array[:nbytes]


@dataclass(frozen=True)
class StagedRuns:
    """Runs of one region received into ``buffer`` (staging), to scatter after."""

    region: Mapped
    offset: np.ndarray
    nbytes: np.ndarray
    buffer: np.ndarray


class Part:
    """One system call's worth of a payload: runs ``(offset, nbytes)`` of base arrays.

    :meth:`iov` is the ``(address, length)`` array for :mod:`~pd_transfer.transport.tcp.native_io`,
    :meth:`views` the same memory as memoryviews for ``socket.sendmsg``.
    """

    __slots__ = ("segments", "staged", "num_iov", "staged_nbytes")

    def __init__(self) -> None:
        self.segments: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.staged: list[StagedRuns] = []
        self.num_iov = 0
        self.staged_nbytes = 0

    def add(self, base: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> None:
        self.segments.append((base, offset, nbytes))
        self.num_iov += len(offset)

    def add_whole(self, base: np.ndarray) -> None:
        self.add(base, _ZERO, np.array([base.size], np.int64))

    def iov(self) -> np.ndarray:
        iov = np.empty((self.num_iov, 2), np.uint64)
        row = 0
        for base, offset, nbytes in self.segments:
            n = len(offset)
            iov[row : row + n, 0] = offset + base.__array_interface__["data"][0]
            iov[row : row + n, 1] = nbytes
            row += n
        return iov

    def views(self) -> list[memoryview]:
        views: list[memoryview] = []
        for base, offset, nbytes in self.segments:
            views.extend(_slices(base.data, offset, nbytes))
        return views


_ZERO = np.zeros(1, np.int64)


def join(offset: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs that continue each other (``offset[i+1] == offset[i] + nbytes[i]``) made one."""
    if len(offset) < 2:
        return offset, nbytes
    breaks = np.flatnonzero(offset[1:] != offset[:-1] + nbytes[:-1]) + 1
    if len(breaks) == len(offset) - 1:
        return offset, nbytes
    starts = np.concatenate(([0], breaks))
    return offset[starts], np.add.reduceat(nbytes, starts)


def _slices(view: memoryview, offset: np.ndarray, nbytes: np.ndarray) -> list[memoryview]:
    # map() keeps the loop in C: about a third faster than a comprehension at 16k slices
    return list(map(view.__getitem__, map(slice, offset.tolist(), (offset + nbytes).tolist())))


def _batches(nbytes: np.ndarray, first_room: int, room: int) -> Iterator[tuple[int, int]]:
    """Cut runs into consecutive batches ``[a, b)`` of at most ``room`` bytes (the first of
    at most ``first_room``); a run larger than ``room`` is a batch of its own."""
    ends = np.cumsum(nbytes)
    a, base, limit = 0, 0, first_room
    while a < len(nbytes):
        b = int(np.searchsorted(ends, base + limit, side="right"))
        if b == a:
            if limit < room:  # the first batch had too little room left: start afresh
                limit = room
                continue
            b = a + 1
        yield a, b
        base, a, limit = int(ends[b - 1]), b, room


class _Parts:
    """Builds parts: a part is handed out when it holds IOV_MAX runs, or before staged runs
    that would overflow the staging buffer it shares with the next part."""

    def __init__(self, stage_nbytes: int, head: np.ndarray | None = None) -> None:
        self.stage_nbytes = stage_nbytes
        self.part = Part()
        if head is not None:
            self.part.add_whole(head)

    def room(self) -> int:
        return self.stage_nbytes - self.part.staged_nbytes

    def take(self) -> Part:
        part, self.part = self.part, Part()
        return part


def _stretches(
    parts: _Parts,
    region: Mapped,
    offset: np.ndarray,
    nbytes: np.ndarray,
    staging: Staging,
    direct_min_nbytes: int,
    receiving: bool,
) -> Iterator[Part]:
    """Add one region's runs to ``parts``, yielding every part that fills up."""
    if int(nbytes.sum()) >= direct_min_nbytes * len(nbytes):  # in place
        for i in range(0, len(offset), IOV_MAX):
            parts.part.add(region.array, offset[i : i + IOV_MAX], nbytes[i : i + IOV_MAX])
            if parts.part.num_iov >= IOV_MAX:
                yield parts.take()
        return
    for a, b in _batches(nbytes, parts.room(), parts.stage_nbytes):
        total = int(nbytes[a:b].sum())
        if total > parts.stage_nbytes:  # one run too big to stage: in place (bounds staging)
            parts.part.add(region.array, offset[a:b], nbytes[a:b])
            continue
        if total > parts.room() and parts.part.num_iov:
            yield parts.take()
        at = parts.part.staged_nbytes
        buffer = staging.take(parts.stage_nbytes)[at : at + total]
        if receiving:
            parts.part.staged.append(StagedRuns(region, offset[a:b], nbytes[a:b], buffer))
        else:
            gather_pieces(region, offset[a:b], nbytes[a:b], buffer)
        parts.part.add_whole(buffer)
        parts.part.staged_nbytes += total


def source_parts(
    layout: ChunkLayout,
    src: Mapping[str, Mapped],
    staging: Staging,
    direct_min_nbytes: int = DIRECT_MIN_NBYTES,
    stage_nbytes: int = STAGE_NBYTES,
    head: np.ndarray | None = None,
) -> Iterator[Part]:
    """The chunk's payload, in order, in parts (``head``, the frame's prefix and header,
    first); each part must be sent before the next is asked for."""
    parts = _Parts(stage_nbytes, head)
    for piece in layout.pieces:
        offset, nbytes = join(piece.src_offset, piece.nbytes)
        yield from _stretches(
            parts, src[piece.src_region], offset, nbytes, staging, direct_min_nbytes, receiving=False
        )
    if parts.part.num_iov:
        yield parts.take()


def destination_parts(
    wire: WireRuns,
    dst: Mapping[str, Mapped],
    staging: Staging,
    direct_min_nbytes: int = RECEIVE_DIRECT_MIN_NBYTES,
    stage_nbytes: int = STAGE_NBYTES,
) -> Iterator[Part]:
    """Where a checked chunk's payload goes, in order, in parts; receive each part, then
    :func:`finish` it, before asking for the next."""
    runs = wire.runs
    if not len(runs):
        return
    cuts = np.flatnonzero(np.diff(runs[:, 0])) + 1
    edges = np.concatenate(([0], cuts, [len(runs)])).tolist()
    parts = _Parts(stage_nbytes)
    for start, stop in zip(edges[:-1], edges[1:]):
        offset, nbytes = join(runs[start:stop, 1], runs[start:stop, 2])
        yield from _stretches(
            parts,
            dst[wire.regions[int(runs[start, 0])]],
            offset,
            nbytes,
            staging,
            direct_min_nbytes,
            receiving=True,
        )
    if parts.part.num_iov:
        yield parts.take()


def finish(part: Part) -> None:
    """Scatter the runs of a received part that went into the staging buffer."""
    for staged in part.staged:
        scatter_pieces(staged.region, staged.offset, staged.nbytes, staged.buffer)
