"""The two halves of a copy for transports that ship bytes: gather and scatter.

Sender: :func:`layout_chunks` cuts a plan's byte stream (its runs in plan
order) into chunks of at most ``chunk_nbytes``; a run crossing a chunk
boundary is split there. Each :class:`ChunkLayout` carries the destination
runs of its bytes (:class:`WireRuns`, what the receiver needs) and the
source pieces to gather. :func:`gather_chunk` packs those pieces back to back
into one fresh buffer (``torch.index_select(out=...)`` per source region).

Receiver: :func:`check_wire` validates a chunk's runs against the regions it
registered (every region known, every run inside it, lengths adding up to the
payload) and :func:`scatter_chunk` copies the payload into place, one
``np.put`` of opaque rows per destination region.

Destination runs that continue each other are joined before they go on the
wire: a sliced TP 2 -> 4 page is 16 pieces of 512 B on the source but one
8 KiB run at the destination, so the header carries one run, not sixteen.

Imports numpy; no asyncio, no zmq.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy import native_loop
from pd_transfer.transport.copy.bounds import check_bounds
from pd_transfer.transport.copy.runs import Flat, Runs, dst_groups, expand, flatten, row_nbytes_for, rows_of
from pd_transfer.transport.regions import Mapped, Regions, map_regions

_ROW_CAP_NBYTES = 1 << 20
_LOOP_MAX_RUNS = 16  # fewer runs than this: slice-copy each, cheaper than building rows


@dataclass(frozen=True)
class WireRuns:
    """Destination runs of one chunk: ``runs[i] = (region index, offset, nbytes)``.

    ``regions`` is the chunk's table of destination region ids; the payload
    holds the runs' bytes back to back, in order.
    """

    regions: tuple[str, ...]
    runs: np.ndarray  # int64, shape (n, 3)

    @property
    def nbytes(self) -> int:
        return int(self.runs[:, 2].sum()) if len(self.runs) else 0


@dataclass(frozen=True)
class _Pieces:
    """Source pieces of one chunk that come from one region, in payload order."""

    src_region: str
    src_offset: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk ``seq`` of a plan: where its bytes come from and where they go."""

    seq: int
    nbytes: int
    wire: WireRuns
    pieces: tuple[_Pieces, ...]


def layout_chunks(
    plan, src_sizes: Mapping[str, int], chunk_nbytes: int, *, dst_sizes: Mapping[str, int] | None = None
) -> list[ChunkLayout]:
    """Cut ``plan`` into chunks; bounds-check the source (and ``dst_sizes`` if given) first."""
    if chunk_nbytes <= 0:
        raise ValueError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
    flat = flatten(plan)
    check_bounds(flat, src_sizes, dst_sizes, f"plan {plan.src_rank} -> {plan.dst_rank}")
    runs = _split_at_chunks(expand(flat), chunk_nbytes)
    if not len(runs):
        return []
    position = np.cumsum(runs.nbytes) - runs.nbytes
    chunk_of = position // chunk_nbytes
    cuts = np.flatnonzero(np.diff(chunk_of)) + 1
    edges = np.concatenate(([0], cuts, [len(runs)])).tolist()
    return [
        _layout_one(seq, runs.take(slice(a, b)), flat)
        for seq, (a, b) in enumerate(zip(edges[:-1], edges[1:]))
    ]


def _split_at_chunks(runs: Runs, chunk_nbytes: int) -> Runs:
    """Split every run that crosses a multiple of ``chunk_nbytes`` in the byte stream."""
    end = np.cumsum(runs.nbytes)
    start = end - runs.nbytes
    first, last = start // chunk_nbytes, (end - 1) // chunk_nbytes
    if not len(runs) or bool((first == last).all()):
        return runs
    parts = last - first + 1
    owner = np.repeat(np.arange(len(runs)), parts)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(parts) - parts, parts)
    chunk = first[owner] + k
    piece_start = np.maximum(start[owner], chunk * chunk_nbytes)
    piece_end = np.minimum(end[owner], (chunk + 1) * chunk_nbytes)
    shift = piece_start - start[owner]
    return Runs(
        runs.batch[owner],
        runs.src_offset[owner] + shift,
        runs.dst_offset[owner] + shift,
        piece_end - piece_start,
    )


def _layout_one(seq: int, runs: Runs, flat: Flat) -> ChunkLayout:
    batches = flat.batches
    # destination side: join runs that continue each other, index regions in a table
    starts = dst_groups(runs)
    group_nbytes = np.add.reduceat(runs.nbytes, starts)
    group_batch = runs.batch[starts]
    # a chunk's batches: a handful, in plan order (where the batch changes; no np.unique,
    # whose hashing cost a tenth of a millisecond per chunk of 8,192 runs)
    batch_ids = group_batch[np.concatenate(([True], group_batch[1:] != group_batch[:-1]))]
    region_of = [batches[b].dst_region for b in batch_ids.tolist()]
    table = tuple(dict.fromkeys(region_of))
    slot = {region_id: i for i, region_id in enumerate(table)}
    wire = np.empty((len(starts), 3), np.int64)
    wire[:, 0] = np.array([slot[r] for r in region_of], np.int64)[np.searchsorted(batch_ids, group_batch)]
    wire[:, 1] = runs.dst_offset[starts]
    wire[:, 2] = group_nbytes
    # source side: one piece list per stretch of runs from the same batch
    cuts = np.flatnonzero(np.diff(runs.batch)) + 1
    edges = np.concatenate(([0], cuts, [len(runs)])).tolist()
    pieces = tuple(
        _Pieces(batches[int(runs.batch[a])].src_region, runs.src_offset[a:b], runs.nbytes[a:b])
        for a, b in zip(edges[:-1], edges[1:])
    )
    return ChunkLayout(seq, int(runs.nbytes.sum()), WireRuns(table, wire), pieces)


def gather_chunk(layout: ChunkLayout, src: Mapping[str, Mapped], out: np.ndarray | None = None) -> np.ndarray:
    """Pack the chunk's source pieces into ``out`` (default: a new contiguous uint8 array).

    ``np.take(mode="clip")`` of opaque source rows straight into the payload:
    numpy, not torch, so no OpenMP team is involved (see :mod:`~pd_transfer.transport.copy.tasks`).
    """
    payload = np.empty(layout.nbytes, np.uint8) if out is None else out[: layout.nbytes]
    position = 0
    for piece in layout.pieces:
        total = int(piece.nbytes.sum())
        gather_pieces(
            src[piece.src_region], piece.src_offset, piece.nbytes, payload[position : position + total]
        )
        position += total
    return payload


def gather_pieces(region: Mapped, offset: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> None:
    """Copy the runs ``(offset, nbytes)`` of ``region`` back to back into ``out``."""
    if native_loop.AVAILABLE and len(nbytes) >= _LOOP_MAX_RUNS:
        native_loop.gather_runs(region.array, offset, nbytes, out)
        return
    if len(nbytes) < _LOOP_MAX_RUNS:
        at = 0
        for o, n in zip(offset.tolist(), nbytes.tolist()):
            out[at : at + n] = region.array[o : o + n]
            at += n
        return
    gs = row_nbytes_for(offset, nbytes, cap=_ROW_CAP_NBYTES)
    rows = region.void_rows(gs)
    np.take(rows, rows_of(offset, nbytes, gs), out=out.view(rows.dtype), mode="clip")


def gather(plan, src_regions: Regions, chunk_nbytes: int = 4 << 20) -> Iterator[tuple[WireRuns, np.ndarray]]:
    """Every chunk of ``plan`` as ``(destination runs, packed bytes)``, in order."""
    src = map_regions(src_regions, (b.src_region for b in plan.batches), "source")
    for layout in layout_chunks(plan, {k: m.nbytes for k, m in src.items()}, chunk_nbytes):
        yield layout.wire, gather_chunk(layout, src)


def scatter_pieces(region: Mapped, offset: np.ndarray, nbytes: np.ndarray, payload: np.ndarray) -> None:
    """Copy ``payload`` (the runs back to back) into the runs ``(offset, nbytes)`` of ``region``."""
    if native_loop.AVAILABLE and len(nbytes) >= _LOOP_MAX_RUNS:
        native_loop.scatter_runs(region.array, offset, nbytes, payload)
        return
    if len(nbytes) < _LOOP_MAX_RUNS:
        at = 0
        for o, n in zip(offset.tolist(), nbytes.tolist()):
            region.array[o : o + n] = payload[at : at + n]
            at += n
        return
    gd = row_nbytes_for(offset, nbytes, cap=_ROW_CAP_NBYTES)
    rows = region.void_rows(gd)
    np.put(rows, rows_of(offset, nbytes, gd), payload.view(rows.dtype))


def check_wire(wire: WireRuns, dst_sizes: Mapping[str, int], payload_nbytes: int) -> None:
    """Refuse a chunk whose runs leave the receiver's regions or miscount the payload."""
    runs = wire.runs
    if runs.ndim != 2 or runs.shape[1] != 3 or runs.dtype != np.int64:
        raise TransportError(
            f"chunk runs must be an (n, 3) int64 array, got {runs.dtype} {runs.shape}", code=Reason.BAD_FRAME
        )
    unknown = [r for r in wire.regions if r not in dst_sizes]
    if unknown:
        raise TransportError(f"chunk names unregistered region(s) {unknown[:5]}", code=Reason.UNKNOWN_REGION)
    slot, offset, nbytes = runs[:, 0], runs[:, 1], runs[:, 2]
    if len(runs) and (int(slot.min()) < 0 or int(slot.max()) >= len(wire.regions)):
        raise TransportError(
            f"chunk run points at region slot outside its table of {len(wire.regions)}", code=Reason.BAD_FRAME
        )
    size = (
        np.array([dst_sizes[r] for r in wire.regions], np.int64)[slot] if len(runs) else np.zeros(0, np.int64)
    )
    # written without a sum that could overflow: 0 <= offset, 0 < nbytes <= size - offset
    bad = (offset < 0) | (nbytes <= 0) | (offset > size) | (nbytes > size - offset)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransportError(
            f"chunk run {i}: {int(nbytes[i])} bytes at offset {int(offset[i])} are outside "
            f"region {wire.regions[int(slot[i])]!r} of {int(size[i])} bytes "
            f"({int(bad.sum())} bad run(s)); nothing was written",
            code=Reason.RUN_OUT_OF_REGION,
        )
    total = int(nbytes.sum()) if len(runs) else 0
    if total != payload_nbytes:
        raise TransportError(
            f"chunk runs add up to {total} bytes but the payload holds {payload_nbytes}",
            code=Reason.BAD_FRAME,
        )


def scatter(wire: WireRuns, payload: np.ndarray, dst_regions: Regions) -> int:
    """Check a chunk against ``dst_regions`` and copy it in; nothing is written if a run is bad."""
    unknown = [r for r in wire.regions if r not in dst_regions]
    if unknown:
        raise TransportError(f"chunk names unregistered region(s) {unknown[:5]}", code=Reason.UNKNOWN_REGION)
    dst = map_regions(dst_regions, wire.regions, "destination")
    check_wire(wire, {r: m.nbytes for r, m in dst.items()}, payload.size)
    return scatter_chunk(wire, payload, dst)


def scatter_chunk(wire: WireRuns, payload: np.ndarray, dst: Mapping[str, Mapped]) -> int:
    """Copy a checked chunk's payload into place; return the bytes written."""
    runs = wire.runs
    if not len(runs):
        return 0
    position = np.cumsum(runs[:, 2]) - runs[:, 2]
    cuts = np.flatnonzero(np.diff(runs[:, 0])) + 1
    edges = np.concatenate(([0], cuts, [len(runs)])).tolist()
    for a, b in zip(edges[:-1], edges[1:]):
        start = int(position[a])
        total = int(runs[a:b, 2].sum())
        scatter_pieces(
            dst[wire.regions[int(runs[a, 0])]], runs[a:b, 1], runs[a:b, 2], payload[start : start + total]
        )
    return int(position[-1] + runs[-1, 2])
