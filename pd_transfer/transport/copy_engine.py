"""The copy engine: executes a transfer plan between two sets of mapped regions.

``CopyEngine.execute(plan, src_regions, dst_regions)`` first bounds-checks
*every* piece of the plan against both sides (one vectorised pass over all
descriptors, :mod:`.runs`); if any piece is out of bounds it raises a
:class:`TransportError` and copies nothing. Then it copies, choosing per
group of runs that continue each other in the destination (a *stretch*):

- a stretch of at least ``stretch_nbytes`` is filled in one pass:
  ``torch.index_select(src_rows, 0, idx, out=dst[stretch])`` (or a plain copy
  when it is one source run);
- shorter stretches go through a small bounce buffer, a chunk at a time:
  ``torch.index_select`` gathers the source rows into it (near copy speed),
  ``np.put`` on a view of the destination as ``gd``-byte opaque items
  scatters it (one memmove per row). The buffer is ~1 MiB per worker so it
  stays in L2 between the two passes.

Rows: a batch's source is viewed as rows of ``gs`` bytes, ``gs`` the gcd of
its source offsets and lengths; its destination as rows of ``gd``, the gcd of
its stretches' offsets and lengths. Worked example, Llama-3.1-8B K of one
layer, prefill TP 2 -> decode TP 4: a source page row holds 16 tokens x 4
heads x 256 B = 16 KiB; decode rank 0 takes heads 0-1 of every token, so the
pieces are 512 B at a 1 KiB stride (gs = 512) and land back to back in an
8 KiB destination page (gd = 8 KiB): 16 gathered rows, one scattered row.

Chunks are spread over a few worker threads (C calls that release the GIL).
Row indices are built with numpy (repeat/cumsum): never a Python loop per run,
except for plans of a handful of runs, copied directly (lowest latency).

Imports numpy and torch; no asyncio, no zmq.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pd_transfer.transport.regions import Mapped, Regions, map_regions, sizes_of
from pd_transfer.transport.runs import (
    Runs,
    check_bounds,
    dst_groups,
    expand,
    expand_batch,
    flatten,
    row_nbytes_for,
    rows_of,
)

_ROW_CAP_NBYTES = 1 << 20


@dataclass(frozen=True)
class _Copy:
    """One source run straight into the destination."""

    src: np.ndarray
    dst: np.ndarray

    def run(self, scratch: _Scratch) -> None:
        np.copyto(self.dst, self.src)


@dataclass(frozen=True)
class _GatherInto:
    """A long destination stretch gathered from source rows in one pass."""

    src_rows: torch.Tensor
    index: torch.Tensor
    dst: torch.Tensor  # 2-D view of the stretch

    def run(self, scratch: _Scratch) -> None:
        torch.index_select(self.src_rows, 0, self.index, out=self.dst)


@dataclass(frozen=True)
class _Bounce:
    """Gather a chunk of short runs into the bounce buffer, scatter it by rows."""

    src_rows: torch.Tensor
    src_index: torch.Tensor
    dst_void: np.ndarray
    dst_index: np.ndarray
    nbytes: int

    def run(self, scratch: _Scratch) -> None:
        gs = self.src_rows.shape[1]
        torch.index_select(self.src_rows, 0, self.src_index,
                           out=scratch.tensor[: self.nbytes].view(-1, gs))
        np.put(self.dst_void, self.dst_index, scratch.array[: self.nbytes].view(self.dst_void.dtype))


class _Scratch:
    """A worker thread's bounce buffer (numpy and torch views of it)."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, np.uint8)
        self.tensor = torch.from_numpy(self.array)


class CopyEngine:
    """Executes plans between mapped regions. Thread-safe; share one per process.

    ``num_workers`` threads (default: up to 2, the CPUs this process may use)
    copy chunks of one plan in parallel once the plan holds more than
    ``inline_nbytes``; smaller plans run in the calling thread.
    """

    def __init__(self, *, num_workers: int | None = None, bounce_nbytes: int = 1 << 20,
                 stretch_nbytes: int = 256 << 10, inline_nbytes: int = 4 << 20,
                 direct_max_runs: int = 128) -> None:
        if num_workers is None:
            num_workers = min(2, len(os.sched_getaffinity(0)))
        self.num_workers = max(1, num_workers)
        self.bounce_nbytes = bounce_nbytes
        self.stretch_nbytes = stretch_nbytes
        self.inline_nbytes = inline_nbytes
        self.direct_max_runs = direct_max_runs
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- public ---------------------------------------------------------------------
    def execute(self, plan, src_regions: Regions, dst_regions: Regions, *,
                where: str = "") -> int:
        """Copy every byte of ``plan``; return the number of bytes copied.

        Raises :class:`TransportError` (UNKNOWN_REGION, REGION_INVALID,
        RUN_OUT_OF_REGION) before a single byte moves.
        """
        where = where or f"plan {plan.src_rank} -> {plan.dst_rank}"
        flat = flatten(plan)
        src = map_regions(src_regions, (b.src_region for b in flat.batches), "source")
        dst = map_regions(dst_regions, (b.dst_region for b in flat.batches), "destination")
        check_bounds(flat, sizes_of(src), sizes_of(dst), where)
        if int(flat.count.sum()) <= self.direct_max_runs:
            _copy_runs_directly(expand(flat), flat.batches, src, dst)
            return flat.total_nbytes
        tasks: list = []
        for i, batch in enumerate(flat.batches):
            runs = expand_batch(batch, i, sort_by_dst=True)
            if len(runs):
                tasks += self._compile_batch(runs, src[batch.src_region], dst[batch.dst_region])
        self._run(tasks, flat.total_nbytes)
        return flat.total_nbytes

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- compile: runs -> tasks -------------------------------------------------------
    def _compile_batch(self, runs: Runs, src: Mapped, dst: Mapped) -> list:
        starts = dst_groups(runs)
        group_nbytes = np.add.reduceat(runs.nbytes, starts)
        group_runs = np.diff(np.append(starts, len(runs)))
        long = group_nbytes >= self.stretch_nbytes
        if not long.any():
            return self._bounce_tasks(runs, runs.dst_offset[starts], group_nbytes, src, dst)
        tasks = [self._stretch_task(runs.take(slice(int(starts[g]), int(starts[g] + group_runs[g]))),
                                    src, dst) for g in np.flatnonzero(long)]
        if not long.all():
            short = runs.take(np.repeat(~long, group_runs))
            tasks += self._bounce_tasks(short, runs.dst_offset[starts[~long]],
                                        group_nbytes[~long], src, dst)
        return tasks

    def _stretch_task(self, runs: Runs, src: Mapped, dst: Mapped):
        first = int(runs.dst_offset[0])
        total = int(runs.nbytes.sum())
        if len(runs) == 1:
            offset = int(runs.src_offset[0])
            return _Copy(src.array[offset:offset + total], dst.array[first:first + total])
        gs = row_nbytes_for(runs.src_offset, runs.nbytes, cap=_ROW_CAP_NBYTES)
        index = torch.from_numpy(rows_of(runs.src_offset, runs.nbytes, gs))
        return _GatherInto(src.rows(gs), index, dst.tensor[first:first + total].view(-1, gs))

    def _bounce_tasks(self, runs: Runs, group_offset: np.ndarray, group_nbytes: np.ndarray,
                      src: Mapped, dst: Mapped) -> list:
        gs = row_nbytes_for(runs.src_offset, runs.nbytes, cap=_ROW_CAP_NBYTES)
        gd = row_nbytes_for(group_offset, group_nbytes, cap=_ROW_CAP_NBYTES)
        src_index = torch.from_numpy(rows_of(runs.src_offset, runs.nbytes, gs))
        dst_index = rows_of(group_offset, group_nbytes, gd)
        # Chunks end on stretch boundaries, which are row boundaries on both sides;
        # a chunk takes the stretches starting in its bounce-sized window, so it
        # holds less than bounce_nbytes + stretch_nbytes.
        position = np.cumsum(group_nbytes) - group_nbytes
        window = position // self.bounce_nbytes
        cuts = np.flatnonzero(np.diff(window)) + 1
        edges = np.concatenate((position[np.concatenate(([0], cuts))], [int(group_nbytes.sum())]))
        src_rows, dst_void = src.rows(gs), dst.void_rows(gd)
        return [_Bounce(src_rows, src_index[a // gs: b // gs], dst_void, dst_index[a // gd: b // gd],
                        int(b - a)) for a, b in zip(edges[:-1].tolist(), edges[1:].tolist())]

    # -- run --------------------------------------------------------------------------
    def _run(self, tasks: list, total_nbytes: int) -> None:
        counter = itertools.count()
        if self.num_workers == 1 or total_nbytes < self.inline_nbytes or len(tasks) < 2:
            self._drain(tasks, counter)
            return
        pool = self._workers()
        helpers = [pool.submit(self._drain, tasks, counter)
                   for _ in range(min(self.num_workers, len(tasks)) - 1)]
        try:
            self._drain(tasks, counter)
        finally:
            for helper in helpers:
                helper.result()

    def _drain(self, tasks: list, counter: itertools.count) -> None:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _Scratch(self.bounce_nbytes + self.stretch_nbytes)
        while (i := next(counter)) < len(tasks):  # next() on a count is atomic under the GIL
            tasks[i].run(scratch)

    def _workers(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers - 1,
                                                thread_name_prefix="pdt-copy")
            return self._pool


def _copy_runs_directly(runs: Runs, batches: tuple, src: dict[str, Mapped],
                        dst: dict[str, Mapped]) -> None:
    """A few runs: slice and copy each (a 1-page room of 64 layers is 64 runs)."""
    for b, s, d, n in zip(runs.batch.tolist(), runs.src_offset.tolist(),
                          runs.dst_offset.tolist(), runs.nbytes.tolist()):
        batch = batches[b]
        dst[batch.dst_region].array[d:d + n] = src[batch.src_region].array[s:s + n]


_default: CopyEngine | None = None
_default_lock = threading.Lock()


def default_engine() -> CopyEngine:
    """The process-wide engine (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CopyEngine()
        return _default


def execute(plan, src_regions: Regions, dst_regions: Regions) -> int:
    """``default_engine().execute(...)``."""
    return default_engine().execute(plan, src_regions, dst_regions)
