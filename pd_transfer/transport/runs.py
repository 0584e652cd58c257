"""Byte-run arithmetic shared by the copy engine and the tcp packer. Pure numpy.

A plan arrives as :class:`~pd_transfer.layout.lowering.RunBatch` descriptors
(``count`` pieces of ``nbytes`` at a stride). This module

- flattens every descriptor of a plan into one set of arrays
  (:func:`flatten`), so a plan of 64 one-run batches is checked with a
  handful of numpy calls, not 64 rounds of them;
- bounds-checks every piece against both regions before anything moves
  (:func:`check_bounds`), naming the first offender;
- expands descriptors to plain runs and runs to fixed-size rows
  (:func:`expand`, :func:`rows_of`), never looping in Python per run.

No torch, no asyncio, no zmq.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError

# Extents are first computed in float64: anything beyond this is out of every
# region, and anything below it is exact in int64 without overflow.
_SAFE_EXTENT = float(2 ** 62)


@dataclass(frozen=True)
class Flat:
    """Every descriptor of a plan, concatenated. ``batch[i]`` indexes ``batches``."""

    batches: tuple  # the plan's RunBatch objects
    batch: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray

    @property
    def total_nbytes(self) -> int:
        return int(np.dot(self.nbytes, self.count))


@dataclass(frozen=True)
class Runs:
    """Plain runs in plan order; ``batch`` says which batch (hence regions) each is from."""

    batch: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def take(self, index: np.ndarray | slice) -> Runs:
        return Runs(self.batch[index], self.src_offset[index], self.dst_offset[index],
                    self.nbytes[index])


def flatten(plan) -> Flat:
    """Concatenate the descriptors of every batch of ``plan``."""
    batches = tuple(plan.batches)
    if not batches:
        empty = np.zeros(0, np.int64)
        return Flat(batches, empty, empty, empty, empty, empty, empty, empty)
    lengths = np.fromiter((len(b.src_offset) for b in batches), np.int64, len(batches))
    for i, b in enumerate(batches):
        if not (len(b.dst_offset) == len(b.nbytes) == len(b.count) == lengths[i]):
            raise TransportError(f"batch {i} ({b.src_region} -> {b.dst_region}): descriptor "
                                 f"arrays differ in length", code=Reason.BAD_FIELD)

    def cat(name: str) -> np.ndarray:
        return np.concatenate([np.asarray(getattr(b, name), dtype=np.int64).reshape(-1)
                               for b in batches])

    def per_batch(name: str) -> np.ndarray:
        values = np.fromiter((int(getattr(b, name)) for b in batches), np.int64, len(batches))
        return np.repeat(values, lengths)

    return Flat(batches, np.repeat(np.arange(len(batches)), lengths), cat("src_offset"),
                cat("dst_offset"), cat("nbytes"), cat("count"), per_batch("src_stride"),
                per_batch("dst_stride"))


def check_bounds(flat: Flat, src_sizes: Mapping[str, int] | None,
                 dst_sizes: Mapping[str, int] | None, where: str = "plan") -> None:
    """Raise :class:`TransportError` unless every piece lies inside its regions.

    ``None`` for a side skips it (the tcp sender checks only its source; the
    receiver checks the destination against what it registered).
    """
    for side, sizes in (("source", src_sizes), ("destination", dst_sizes)):
        if sizes is None:
            continue
        attr = "src_region" if side == "source" else "dst_region"
        region_ids = [getattr(b, attr) for b in flat.batches]
        missing = sorted({r for r in region_ids if r not in sizes})
        if missing:
            raise TransportError(f"{where}: {side} region(s) {missing} are not mapped "
                                 f"(known: {len(sizes)} regions)", code=Reason.UNKNOWN_REGION)
        size = np.array([sizes[r] for r in region_ids], np.int64)[flat.batch] \
            if len(flat.batch) else np.zeros(0, np.int64)
        offset = flat.src_offset if side == "source" else flat.dst_offset
        stride = flat.src_stride if side == "source" else flat.dst_stride
        bad = _out_of_bounds(offset, flat.nbytes, flat.count, stride, size)
        if bad.any():
            _raise_out_of_bounds(flat, np.flatnonzero(bad), side, region_ids, size, where)


def _out_of_bounds(offset: np.ndarray, nbytes: np.ndarray, count: np.ndarray,
                   stride: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per descriptor: does any of its pieces leave ``[0, size)``?"""
    span = (count.astype(np.float64) - 1) * stride
    lo_f = offset + np.minimum(span, 0)
    hi_f = offset + np.maximum(span, 0) + nbytes
    empty = (count == 0) | (nbytes == 0)
    huge = (np.abs(lo_f) >= _SAFE_EXTENT) | (np.abs(hi_f) >= _SAFE_EXTENT)
    with np.errstate(over="ignore"):
        span_i = np.where(huge, 0, (count - 1) * stride)
        lo = offset + np.minimum(span_i, 0)
        hi = offset + np.maximum(span_i, 0) + nbytes
    negative = (count < 0) | (nbytes < 0)
    return negative | (~empty & (huge | (lo < 0) | (hi > size)))


def _raise_out_of_bounds(flat: Flat, bad: np.ndarray, side: str, region_ids: list[str],
                         size: np.ndarray, where: str) -> None:
    i = int(bad[0])
    b = int(flat.batch[i])
    first = i - int(np.searchsorted(flat.batch, b))
    offset = int((flat.src_offset if side == "source" else flat.dst_offset)[i])
    stride = int((flat.src_stride if side == "source" else flat.dst_stride)[i])
    nbytes, count = int(flat.nbytes[i]), int(flat.count[i])
    piece = f"{count} piece(s) of {nbytes} bytes at offset {offset}"
    if count > 1:
        piece += f", stride {stride} (last piece ends at {offset + (count - 1) * stride + nbytes})"
    raise TransportError(
        f"{where}: batch {b} descriptor {first}: {piece} is outside {side} region "
        f"{region_ids[b]!r} of {int(size[i])} bytes; {len(bad)} descriptor(s) out of bounds, "
        f"nothing was copied", code=Reason.RUN_OUT_OF_REGION,
        hint="the plan and the registered regions disagree: re-register, or the peer's "
             "geometry is stale")


def expand(flat: Flat) -> Runs:
    """Plain runs (one per piece), in plan order, zero-length pieces dropped."""
    keep = (flat.count > 0) & (flat.nbytes > 0)
    if not keep.all():
        flat = Flat(flat.batches, *(a[keep] for a in (flat.batch, flat.src_offset, flat.dst_offset,
                                                      flat.nbytes, flat.count, flat.src_stride,
                                                      flat.dst_stride)))
    if len(flat.count) == 0 or int(flat.count.max()) == 1:
        return Runs(flat.batch, flat.src_offset, flat.dst_offset, flat.nbytes)
    owner = np.repeat(np.arange(len(flat.count)), flat.count)
    step = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(flat.count) - flat.count,
                                                             flat.count)
    return Runs(flat.batch[owner], flat.src_offset[owner] + step * flat.src_stride[owner],
                flat.dst_offset[owner] + step * flat.dst_stride[owner], flat.nbytes[owner])


def expand_batch(batch, index: int = 0, *, sort_by_dst: bool = False) -> Runs:
    """The runs of one :class:`RunBatch` (already bounds-checked).

    In descriptor order, or with ``sort_by_dst`` in destination order (of
    descriptors; a descriptor's pieces stay together), so that runs filling
    neighbouring destination bytes become neighbours and join into stretches.

    Lowering gives most batches one ``count`` for every descriptor (a page's
    16 token pieces), and then the pieces are a broadcast sum, several times
    cheaper than the general repeat/cumsum expansion.
    """
    src_offset = np.asarray(batch.src_offset, np.int64)
    dst_offset = np.asarray(batch.dst_offset, np.int64)
    nbytes = np.asarray(batch.nbytes, np.int64)
    count = np.asarray(batch.count, np.int64)
    keep = (count > 0) & (nbytes > 0)
    if not keep.all():
        src_offset, dst_offset, nbytes, count = (a[keep] for a in (src_offset, dst_offset, nbytes,
                                                                   count))
    if sort_by_dst and len(dst_offset) > 1 and not bool((np.diff(dst_offset) >= 0).all()):
        order = np.argsort(dst_offset, kind="stable")
        src_offset, dst_offset, nbytes, count = (a[order] for a in (src_offset, dst_offset, nbytes,
                                                                    count))
    n = len(count)
    if n and int(count.min()) == int(count.max()):
        steps = np.arange(int(count[0]), dtype=np.int64)
        src = (src_offset[:, None] + steps * batch.src_stride).ravel()
        dst = (dst_offset[:, None] + steps * batch.dst_stride).ravel()
        return Runs(np.full(len(src), index, np.int64), src, dst, np.repeat(nbytes, int(count[0])))
    flat = Flat((batch,), np.full(n, index, np.int64), src_offset, dst_offset, nbytes, count,
                np.full(n, batch.src_stride, np.int64), np.full(n, batch.dst_stride, np.int64))
    return expand(flat)


def rows_of(offset: np.ndarray, nbytes: np.ndarray, row_nbytes: int) -> np.ndarray:
    """Row indices covered by runs, in order, for a region seen as rows of ``row_nbytes``.

    Runs ``(offset=32, nbytes=32)`` and ``(offset=0, nbytes=16)`` with 16-byte
    rows -> ``[2, 3, 0]``. Every offset and length must be a multiple of the row.
    """
    first = offset // row_nbytes
    if len(nbytes) == 0:
        return first
    per_run = nbytes // row_nbytes
    low, high = int(per_run.min()), int(per_run.max())
    if high == 1:
        return first
    if low == high:  # every run the same length: a broadcast sum
        return (first[:, None] + np.arange(low, dtype=np.int64)).ravel()
    total = int(per_run.sum())
    first_out = np.cumsum(per_run) - per_run
    return np.repeat(first - first_out, per_run) + np.arange(total, dtype=np.int64)


def row_nbytes_for(*arrays: np.ndarray, cap: int) -> int:
    """The largest row size dividing every value, at most ``cap`` (and at least 1)."""
    common = int(np.gcd.reduce(np.concatenate([np.asarray(a, np.int64).reshape(-1)
                                               for a in arrays]))) if arrays else 1
    if common <= 0:
        return 1
    if common <= cap:
        return common
    divisor = -(-common // cap)
    while common % divisor:  # smallest divisor >= common / cap gives the largest row <= cap
        divisor += 1
    return common // divisor


def dst_groups(runs: Runs) -> np.ndarray:
    """Start indices of maximal groups of runs that continue each other in the destination.

    Two runs join when they come from the same batch and the second starts in
    the destination where the first ends (the pieces of a sliced head that
    fill one destination page back to back).
    """
    n = len(runs)
    if n == 0:
        return np.zeros(0, np.int64)
    joins = (runs.batch[1:] == runs.batch[:-1]) & \
        (runs.dst_offset[1:] == runs.dst_offset[:-1] + runs.nbytes[:-1])
    return np.flatnonzero(np.concatenate(([True], ~joins)))
