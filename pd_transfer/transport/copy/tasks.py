"""Compiling a checked plan into copy tasks for the engine's workers. numpy only.

Pieces are grouped into *stretches*: pieces of one batch that fill consecutive
destination bytes (descriptors are sorted by destination first, so
neighbouring decode pages join). Four kinds of task (:mod:`.kinds`):

- :class:`CopyRun`: a long stretch that is one source run, one memcpy;
- :class:`TakeInto`: a long stretch of several source runs, gathered straight
  into the destination with ``np.take(src_rows, idx, out=dst_stretch)``;
- :class:`PutFrom`: the mirror image, for what is left: pieces that read
  consecutive *source* bytes (a prefill request on fresh pages, landing on
  scattered decode pages) are scattered straight from the source with
  ``np.put(dst_rows, idx, src_stretch)``;
- :class:`Bounce`: the rest, a chunk at a time: ``np.take`` gathers their
  source rows into a bounce buffer (small enough to stay in cache),
  ``np.put`` scatters the buffer by destination rows.

Every task but a bounce passes over its bytes once. Tasks longer than
``split_nbytes`` are cut into pieces of about that length, so that the
engine's threads share one long stretch (a single 256 MiB run included).
A plan of scattered pieces of one power-of-two size that would all be
bounced anyway (random 2 KiB head slices) takes a shortcut to its bounce
tasks: a shift, a sort and a slice per buffer (:func:`_uniform_bounce`).

Rows: a region is viewed as opaque items of ``g`` bytes (numpy void), so one
take or put moves a whole row with one memmove. ``g`` is per batch: the gcd of
the batch's source offsets and lengths (``gs``) or of its stretches'
destination offsets and lengths (``gd``). Everything is computed for all
batches at once (``np.gcd.reduceat``, broadcast sums); Python loops only over
tasks: one per long stretch, one per bounce buffer of short ones.

Why numpy and not torch: ``torch.index_select`` is as fast on one thread but
uses OpenMP across cores, and on a busy 2-core host one call of a few hundred
microseconds then waits milliseconds for a descheduled team thread. numpy's
take/put run on the calling thread only; the engine spreads tasks over its own
threads. ``mode="clip"`` on take: the default "raise" copies the output once
more, and every index was bounds-checked before compiling.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.transport.copy.kinds import Bounce, CopyRun, PutFrom, TakeInto, split_tasks, void_dtype
from pd_transfer.transport.copy.runs import (
    Flat,
    Items,
    batch_order,
    capped_rows,
    dst_items,
    item_groups,
    rows_of,
)
from pd_transfer.transport.regions import Mapped

ROW_CAP_NBYTES = 1 << 20
SMALL_PIECE_NBYTES = 4 << 10
SPLIT_NBYTES = 4 << 20
# sorting by source pays only where the pieces fill most of the source bytes they span
SOURCE_FILL_MIN = 2 / 3


def compile_tasks(
    flat: Flat,
    src: dict[str, Mapped],
    dst: dict[str, Mapped],
    *,
    stretch_nbytes: int,
    bounce_nbytes: int,
    split_nbytes: int = SPLIT_NBYTES,
) -> list:
    """Tasks that together copy every piece of ``flat`` (already bounds-checked).

    Stretches are taken from the side whose pieces lie closer together first (the
    destination unless the source is fuller), then from the other side among the
    pieces left; the rest is bounced.
    """
    uniform = _uniform_bounce(flat, src, dst, stretch_nbytes, bounce_nbytes)
    if uniform is not None:
        return uniform
    items = dst_items(flat)
    if not len(items):
        return []
    tasks: list = []
    single = np.flatnonzero(items.count == 1)
    batch, piece = items.batch[single], items.piece_nbytes[single]
    src_fill = _fill(batch, items.src_offset[single], piece) if len(single) > 1 else 0.0
    source_first = src_fill > SOURCE_FILL_MIN and src_fill > _fill(batch, items.dst_offset[single], piece)
    if source_first:
        put, items = _source_stretch_tasks(items, flat.batches, src, dst, stretch_nbytes)
        tasks += put
    if len(items):
        starts = item_groups(items)
        group_nbytes = np.add.reduceat(items.nbytes, starts)
        group_items = np.diff(np.append(starts, len(items)))
        long = group_nbytes >= _long_from(items.piece_nbytes[starts], stretch_nbytes)
        if long.any():
            tasks += _stretch_tasks(
                items, starts[long], group_items[long], group_nbytes[long], flat.batches, src, dst
            )
            items = items.take(np.repeat(~long, group_items))
    if not source_first and src_fill >= SOURCE_FILL_MIN and (items.count == 1).sum() > 1:
        put, items = _source_stretch_tasks(items, flat.batches, src, dst, stretch_nbytes)
        tasks += put
    if len(items):
        starts = item_groups(items)
        tasks += _bounce_tasks(
            items, starts, np.add.reduceat(items.nbytes, starts), flat.batches, src, dst, bounce_nbytes
        )
    return split_tasks(tasks, split_nbytes)


def _uniform_bounce(
    flat: Flat, src: dict[str, Mapped], dst: dict[str, Mapped], stretch_nbytes: int, bounce_nbytes: int
) -> list | None:
    """The bounce tasks of a plan of scattered pieces of one size, the shortcut; None when
    the plan is not one.

    Pieces of one power-of-two size ``L``, one per descriptor, at multiples of ``L``
    on both sides, are rows of ``L`` bytes: no gcd, no expansion, no grouping. When
    they fill at most :data:`SOURCE_FILL_MIN` of the source bytes they span and no
    run of them continues itself in the destination for a long stretch, the general
    compiler would bounce every one of them; here that is a bit shift, one sort by
    destination and a slice per bounce buffer (65,536 random 2 KiB pieces: the
    general compiler took 8-14 ms, most of the plan's overhead over its copy).
    """
    n = len(flat.nbytes)
    if n < 2:
        return None
    size = int(flat.nbytes[0])
    if (
        size <= 0
        or size & (size - 1)
        or size >= stretch_nbytes
        or size > ROW_CAP_NBYTES
        or int(flat.count.max()) != 1
        or int(flat.count.min()) != 1
        or int(flat.nbytes.max()) != size
        or int(flat.nbytes.min()) != size
        or int(np.bitwise_or.reduce(flat.src_offset | flat.dst_offset)) & (size - 1)
    ):
        return None
    if _fill(flat.batch, flat.src_offset, size) > SOURCE_FILL_MIN:
        return None
    shift = size.bit_length() - 1
    order = batch_order(flat.batch, flat.dst_offset)
    batch, src_rows, dst_rows = flat.batch, flat.src_offset >> shift, flat.dst_offset >> shift
    if order is not None:
        batch, src_rows, dst_rows = batch[order], src_rows[order], dst_rows[order]
    # a stretch long enough for the general compiler to fill in place: ``k`` rows of one
    # batch, in order, spanning ``k - 1`` (repeated rows may say so falsely: no harm)
    k = int(_long_from(np.array([size]), stretch_nbytes)[0]) // size
    one_batch = len(flat.batches) == 1
    if k <= n and bool(
        (
            (dst_rows[k - 1 :] - dst_rows[: n - k + 1] == k - 1)
            & (True if one_batch else batch[k - 1 :] == batch[: n - k + 1])
        ).any()
    ):
        return None
    return _uniform_bounces(flat, src, dst, size, batch, src_rows, dst_rows, bounce_nbytes)


def _uniform_bounces(
    flat: Flat,
    src: dict[str, Mapped],
    dst: dict[str, Mapped],
    size: int,
    batch: np.ndarray,
    src_rows: np.ndarray,
    dst_rows: np.ndarray,
    bounce_nbytes: int,
) -> list:
    """The uniform plan's bounces: ``size``-byte rows in destination order, a bounce
    buffer's worth at a time, never across a batch."""
    n = len(batch)
    per_task = max(1, bounce_nbytes // size)
    one_batch = len(flat.batches) == 1
    edges = np.zeros(0, np.int64) if one_batch else np.flatnonzero(batch[1:] != batch[:-1]) + 1
    tasks = []
    for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), n]):
        b = flat.batches[int(batch[lo])]
        src_view, dst_view = src[b.src_region].void_rows(size), dst[b.dst_region].void_rows(size)
        tasks += [
            Bounce(
                src_view,
                src_rows[a : min(a + per_task, hi)],
                dst_view,
                dst_rows[a : min(a + per_task, hi)],
                (min(a + per_task, hi) - a) * size,
            )
            for a in range(lo, hi, per_task)
        ]
    return tasks


def _long_from(piece_nbytes: np.ndarray, stretch_nbytes: int) -> np.ndarray:
    """The length from which a stretch starting with pieces of ``piece_nbytes`` skips the
    bounce buffer. Small pieces (head slices) from half the length: their bounce would be
    a second pass over the bytes, and one numpy call per 64 KiB costs less than that
    (TP 2 -> 4 of Llama-3.1-8B, 512 B pieces: 4.15 -> 4.75 GB/s)."""
    return np.where(piece_nbytes < SMALL_PIECE_NBYTES, stretch_nbytes // 2, stretch_nbytes)


def _source_gcd(items: Items) -> np.ndarray:
    """Per item: the gcd of its source offset, piece length and (for several pieces) stride."""
    common = np.gcd(items.src_offset, items.piece_nbytes)
    if int(items.count.max()) == 1:
        return common
    return np.gcd(common, np.where(items.count > 1, items.src_stride, 0))


def _source_rows(items: Items, row: np.ndarray) -> np.ndarray:
    """Source row indices of every item's pieces, rows of ``row[i]`` bytes for item ``i``.

    When every item has the same row size, piece count and rows per piece (a
    sliced batch: 16 pieces of one 512 B row each), the indices are one
    broadcast sum in row units: ``base[i] + j * stride_rows[i] + k``.
    """
    size = int(row[0])
    per_piece = items.piece_nbytes // size
    if (
        int(row.min()) == size == int(row.max())
        and len(items)
        and int(items.count.min()) == int(items.count.max())
        and int(per_piece.min()) == int(per_piece.max())
    ):
        count, rows = int(items.count[0]), int(per_piece[0])
        base = items.src_offset // size
        stride = items.src_stride // size if count > 1 else np.zeros_like(base)
        grid = base[:, None] + stride[:, None] * np.arange(count, dtype=np.int64)
        if rows > 1:
            grid = grid[:, :, None] + np.arange(rows, dtype=np.int64)
        return grid.ravel()
    offsets, nbytes = items.source_offsets()
    return rows_of(offsets, nbytes, np.repeat(row, items.count))


def _stretch_tasks(
    items: Items,
    starts: np.ndarray,
    counts: np.ndarray,
    nbytes: np.ndarray,
    batches: tuple,
    src: dict[str, Mapped],
    dst: dict[str, Mapped],
) -> list:
    first = np.cumsum(counts) - counts
    members = np.repeat(starts - first, counts) + np.arange(int(counts.sum()))
    mine = items.take(members)
    row = capped_rows(np.gcd.reduceat(_source_gcd(mine), first), ROW_CAP_NBYTES)
    index = _source_rows(mine, np.repeat(row, counts))
    index_end = np.cumsum(nbytes // row).tolist()
    tasks: list[CopyRun | TakeInto] = []
    for batch_index, at, n, count, pieces, offset, size, stop in zip(
        items.batch[starts].tolist(),
        items.dst_offset[starts].tolist(),
        nbytes.tolist(),
        counts.tolist(),
        items.count[starts].tolist(),
        items.src_offset[starts].tolist(),
        row.tolist(),
        index_end,
    ):
        batch = batches[batch_index]
        s, d = src[batch.src_region], dst[batch.dst_region]
        if count == 1 and pieces == 1:
            tasks.append(CopyRun(s.array[offset : offset + n], d.array[at : at + n]))
        else:
            tasks.append(
                TakeInto(
                    s.void_rows(size),
                    index[stop - n // size : stop],
                    d.array[at : at + n].view(void_dtype(size)),
                )
            )
    return tasks


def _source_stretch_tasks(
    items: Items, batches: tuple, src: dict[str, Mapped], dst: dict[str, Mapped], stretch_nbytes: int
) -> tuple[list, Items]:
    """:class:`PutFrom` tasks for the single-piece items that continue each other in the
    source over a long stretch, and the items left (still by batch and destination)."""
    single = np.flatnonzero(items.count == 1)
    order = batch_order(items.batch[single], items.src_offset[single])
    candidates = single if order is None else single[order]
    batch, offset = items.batch[candidates], items.src_offset[candidates]
    nbytes = items.piece_nbytes[candidates]
    joins = (batch[1:] == batch[:-1]) & (offset[1:] == offset[:-1] + nbytes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    counts = np.diff(np.append(starts, len(candidates)))
    group_nbytes = np.add.reduceat(nbytes, starts)
    long = (counts > 1) & (group_nbytes >= _long_from(nbytes[starts], stretch_nbytes))
    if not long.any():
        return [], items
    used = candidates[np.repeat(long, counts)]
    counts, group_nbytes = counts[long], group_nbytes[long]
    first = np.cumsum(counts) - counts
    dst_offset, piece = items.dst_offset[used], items.piece_nbytes[used]
    row = capped_rows(np.gcd.reduceat(np.gcd(dst_offset, piece), first), ROW_CAP_NBYTES)
    index = rows_of(dst_offset, piece, np.repeat(row, counts))
    index_end = np.cumsum(group_nbytes // row).tolist()
    tasks = []
    for batch_index, at, n, size, stop in zip(
        items.batch[used[first]].tolist(),
        items.src_offset[used[first]].tolist(),
        group_nbytes.tolist(),
        row.tolist(),
        index_end,
    ):
        b = batches[batch_index]
        tasks.append(
            PutFrom(
                dst[b.dst_region].void_rows(size),
                index[stop - n // size : stop],
                src[b.src_region].array[at : at + n].view(void_dtype(size)),
            )
        )
    left = np.ones(len(items), bool)
    left[used] = False
    return tasks, items.take(left)


def _fill(batch: np.ndarray, offset: np.ndarray, nbytes: np.ndarray | int) -> float:
    """How much of the bytes they span, batch by batch, pieces fill on one side (1.0:
    back to back; random 2 KiB pieces of a pool twice their size: about 0.5, not worth
    a sort). ``batch`` in order; ``nbytes`` per piece, or one length for all."""
    first = np.flatnonzero(np.concatenate(([True], batch[1:] != batch[:-1])))
    if isinstance(nbytes, int):
        span = np.maximum.reduceat(offset, first) + nbytes - np.minimum.reduceat(offset, first)
        return len(offset) * nbytes / max(1, int(span.sum()))
    span = np.maximum.reduceat(offset + nbytes, first) - np.minimum.reduceat(offset, first)
    return int(nbytes.sum()) / max(1, int(span.sum()))


def _bounce_tasks(
    items: Items,
    group_starts: np.ndarray,
    group_nbytes: np.ndarray,
    batches: tuple,
    src: dict[str, Mapped],
    dst: dict[str, Mapped],
    bounce_nbytes: int,
) -> list:
    group_offset = items.dst_offset[group_starts]
    group_batch = items.batch[group_starts]
    # per batch: source rows (gs) and destination rows (gd)
    item_first = np.flatnonzero(np.concatenate(([True], items.batch[1:] != items.batch[:-1])))
    group_first = np.flatnonzero(np.concatenate(([True], group_batch[1:] != group_batch[:-1])))
    gs = capped_rows(np.gcd.reduceat(_source_gcd(items), item_first), ROW_CAP_NBYTES)
    gd = capped_rows(np.gcd.reduceat(np.gcd(group_offset, group_nbytes), group_first), ROW_CAP_NBYTES)
    gs_item = np.repeat(gs, np.diff(np.append(item_first, len(items))))
    gd_group = np.repeat(gd, np.diff(np.append(group_first, len(group_starts))))
    src_index = _source_rows(items, gs_item)
    dst_index = rows_of(group_offset, group_nbytes, gd_group)
    src_before = np.concatenate(([0], np.cumsum(items.nbytes // gs_item)))
    dst_before = np.concatenate(([0], np.cumsum(group_nbytes // gd_group)))
    # chunks: the stretches of one batch whose start falls in one bounce-sized
    # window; a chunk ends on a stretch boundary, a row boundary on both sides
    end = np.cumsum(group_nbytes)
    start = end - group_nbytes
    batch_start = np.repeat(start[group_first], np.diff(np.append(group_first, len(group_starts))))
    window = (start - batch_start) // bounce_nbytes
    chunk_first = np.flatnonzero(
        np.concatenate(([True], (group_batch[1:] != group_batch[:-1]) | (window[1:] != window[:-1])))
    )
    chunk_stop = np.append(chunk_first[1:], len(group_starts))  # one past the last group
    item_stop = np.append(group_starts, len(items))
    ordinal = np.searchsorted(group_first, chunk_first, side="right") - 1
    tasks = []
    for g0, g1, b in zip(chunk_first.tolist(), chunk_stop.tolist(), ordinal.tolist()):
        batch = batches[int(group_batch[g0])]
        tasks.append(
            Bounce(
                src[batch.src_region].void_rows(int(gs[b])),
                src_index[src_before[group_starts[g0]] : src_before[item_stop[g1]]],
                dst[batch.dst_region].void_rows(int(gd[b])),
                dst_index[dst_before[g0] : dst_before[g1]],
                int(end[g1 - 1] - start[g0]),
            )
        )
    return tasks
