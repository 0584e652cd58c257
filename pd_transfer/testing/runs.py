"""Executing a transfer plan's byte runs on the oracle's numpy buffers.

A plan is duck-typed: ``plan.src_rank`` and ``plan.dst_rank`` are rank ids,
``plan.batches`` yields objects with ``src_region``, ``dst_region`` and
``byte_runs() -> (src_offset, dst_offset, nbytes)`` (int arrays, offsets in
bytes from the region start). Every run of every batch is bounds-checked
before the first byte moves, so a refused plan leaves the world untouched.

Copies are vectorised: runs become flat gather/scatter indices built with
``np.repeat`` and a cumulative sum, in chunks of bounded size; there is no
Python loop per run.

Destination bytes written more than once (two runs of one plan, or two plans)
are recorded: the second writer copies identical bytes, so a byte-exact check
alone would never see that the planner failed to elect a single writer.

Imports numpy only; never the planner, reconciliation, lowering or sharding
modules (this is what they are checked against).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import PlanError, Reason

CHUNK_NBYTES = 1 << 24  # bounds the index arrays (16 B of indices per byte copied)


@dataclass(frozen=True)
class BatchRuns:
    """The validated byte runs of one batch."""

    src_region: str
    dst_region: str
    src_offset: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray


def load_runs(
    batch, where: str, src_regions: dict[str, np.ndarray], dst_regions: dict[str, np.ndarray]
) -> BatchRuns:
    """Read one batch's runs and refuse any that leave its regions."""
    for side, region, regions in (
        ("source", batch.src_region, src_regions),
        ("destination", batch.dst_region, dst_regions),
    ):
        if region not in regions:
            raise PlanError(
                f"{where}: {side} region {region!r} is not registered", code=Reason.UNKNOWN_REGION
            )
    arrays = [np.asarray(a) for a in batch.byte_runs()]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise PlanError(
            f"{where}: byte_runs() returned arrays of shapes {[a.shape for a in arrays]}",
            code=Reason.INDEX_COUNT_MISMATCH,
        )
    if any(a.size and a.dtype.kind not in "iu" for a in arrays):
        raise PlanError(f"{where}: byte_runs() returned non-integer arrays", code=Reason.INDEX_OUT_OF_RANGE)
    src_offset, dst_offset, nbytes = (a.astype(np.int64) for a in arrays)
    _check_bounds(where, "source", batch.src_region, src_offset, nbytes, src_regions[batch.src_region].size)
    _check_bounds(
        where, "destination", batch.dst_region, dst_offset, nbytes, dst_regions[batch.dst_region].size
    )
    return BatchRuns(batch.src_region, batch.dst_region, src_offset, dst_offset, nbytes)


def _check_bounds(
    where: str, side: str, region: str, offset: np.ndarray, nbytes: np.ndarray, region_nbytes: int
) -> None:
    # offset <= size and nbytes <= size - offset: no int64 overflow possible
    bad = (offset < 0) | (nbytes < 0) | (offset > region_nbytes) | (nbytes > region_nbytes - offset)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"{where}: {int(np.count_nonzero(bad))} run(s) out of bounds of {side} region "
            f"{region!r} ({region_nbytes} bytes); first: run {i} offset {int(offset[i])} "
            f"nbytes {int(nbytes[i])}",
            code=Reason.VIEW_OUT_OF_REGION,
        )


def flat_indices(offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Every byte address the runs cover, run after run.

    Runs (10, 3) and (50, 2) give [10, 11, 12, 50, 51]: repeat each run's
    offset minus the bytes before it, then add a running position.
    """
    before = np.cumsum(nbytes) - nbytes
    total = int(nbytes.sum())
    return np.repeat(offset - before, nbytes) + np.arange(total, dtype=np.int64)


def _chunks(nbytes: np.ndarray):
    """Slices of consecutive runs, each covering at most CHUNK_NBYTES (or one run)."""
    ends = np.cumsum(nbytes)
    start = 0
    while start < nbytes.size:
        limit = (int(ends[start - 1]) if start else 0) + CHUNK_NBYTES
        stop = max(int(np.searchsorted(ends, limit, side="right")), start + 1)
        yield slice(start, stop)
        start = stop


def copy_runs(src: np.ndarray, dst: np.ndarray, runs: BatchRuns) -> None:
    """Copy validated runs from ``src`` to ``dst``, a bounded chunk of runs at a time."""
    for part in _chunks(runs.nbytes):
        dst[flat_indices(runs.dst_offset[part], runs.nbytes[part])] = src[
            flat_indices(runs.src_offset[part], runs.nbytes[part])
        ]


def self_overlap(dst_offset: np.ndarray, nbytes: np.ndarray) -> tuple[int, int]:
    """(runs overlapping another run of the same list, first such byte), or (0, -1)."""
    keep = nbytes > 0
    offset, length = dst_offset[keep], nbytes[keep]
    if offset.size < 2:
        return 0, -1
    order = np.argsort(offset, kind="stable")
    offset, end = offset[order], offset[order] + length[order]
    reach = np.maximum.accumulate(end)[:-1]  # furthest byte any earlier-starting run reaches
    clash = offset[1:] < reach
    if not np.any(clash):
        return 0, -1
    return int(np.count_nonzero(clash)), int(offset[1:][clash][0])


def mark_written(written: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> tuple[int, int]:
    """Mark the runs' bytes in ``written``.

    Returns (bytes that an earlier call had already marked, the first of
    them), or (0, -1). Overlaps among the runs themselves are
    :func:`self_overlap`'s business, so every chunk is checked before any is
    marked.
    """
    count, first = 0, -1
    for part in _chunks(nbytes):
        idx = flat_indices(offset[part], nbytes[part])
        again = written[idx]
        if np.any(again):
            count += int(np.count_nonzero(again))
            first = int(idx[np.argmax(again)]) if first < 0 else first
    for part in _chunks(nbytes):
        written[flat_indices(offset[part], nbytes[part])] = True
    return count, first
