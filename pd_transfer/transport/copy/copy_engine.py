"""The copy engine: executes a transfer plan between two sets of mapped regions.

``CopyEngine.execute(plan, src_regions, dst_regions)`` first bounds-checks
*every* piece of the plan against both sides (one vectorised pass over all
descriptors, :mod:`~pd_transfer.transport.copy.runs`); if any piece is out of bounds it raises a
:class:`TransportError` and copies nothing. Then it copies:

- a grid plan (a 1-page room, :mod:`pd_transfer.layout.grids`) is checked per
  grid and copied by the native loop in one call per grid, on the calling
  thread (:mod:`~pd_transfer.transport.copy.grid`);
- plans of a few hundred runs are checked piece by piece in Python, then
  copied on the calling thread: lowest latency (a vectorised pass costs more
  than it saves there);
- with the native copy loop (:mod:`~pd_transfer.transport.copy.native_loop`, built at install), every
  other plan is copied by C in byte ranges, one per thread, non-temporal
  stores for pieces of 1 KiB and more;
- without it, larger plans are compiled into numpy tasks (:mod:`~pd_transfer.transport.copy.tasks`): long destination
  stretches (from 128 KiB; from 64 KiB when gathered from pieces under 4 KiB)
  are filled in one pass, short runs go through a bounce buffer
  (gather by source rows, scatter by destination rows), about one task per
  megabyte, taken in turn by the calling thread and the engine's workers;
  the plan's last run, when small (a room's aux row), is copied after all
  of them, so that it lands last.

Worked example, Llama-3.1-8B K of one layer, prefill TP 2 -> decode TP 4: a
source page row holds 16 tokens x 4 heads x 256 B = 16 KiB; decode rank 0
takes heads 0-1 of every token, so the pieces are 512 B at a 1 KiB stride
(source rows of 512 B) and land back to back in an 8 KiB destination page
(destination rows of 8 KiB): 16 rows gathered per row scattered.

Imports numpy only (regions may be torch tensors); no asyncio, no zmq.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_transfer.layout.grids import GridPlan
from pd_transfer.transport.copy import grid, native_loop
from pd_transfer.transport.copy.bounds import check_bounds
from pd_transfer.transport.copy.kinds import BounceBuffer
from pd_transfer.transport.copy.runs import flatten
from pd_transfer.transport.copy.tasks import compile_tasks
from pd_transfer.transport.regions import Mapped, Regions, map_one, map_regions, sizes_of

LAST_RUN_NBYTES = 1 << 20  # a last run up to this size is copied after the others


class CopyEngine:
    """Executes plans between mapped regions. Thread-safe; share one per process.

    ``num_workers`` threads (default: up to 2, the CPUs this process may use;
    the calling thread counts as one) copy the tasks of a plan of more than
    ``inline_nbytes``; smaller plans run in the calling thread alone.
    ``native`` (default: when it is built) copies with the native loop.
    """

    def __init__(
        self,
        *,
        num_workers: int | None = None,
        bounce_nbytes: int = 1 << 20,
        stretch_nbytes: int = 128 << 10,
        inline_nbytes: int = 4 << 20,
        direct_max_runs: int = 256,
        native: bool | None = None,
    ) -> None:
        if native and not native_loop.AVAILABLE:
            raise ValueError(f"the native copy loop is unavailable: {native_loop.UNAVAILABLE_WHY}")
        self.native = native_loop.AVAILABLE if native is None else native
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
    def execute(
        self,
        plan,
        src_regions: Regions,
        dst_regions: Regions,
        *,
        where: str = "",
        programs: dict | None = None,
    ) -> int:
        """Copy every byte of ``plan``; return the number of bytes copied.

        Raises :class:`TransportError` (UNKNOWN_REGION, REGION_INVALID,
        RUN_OUT_OF_REGION) before a single byte moves. A :class:`GridPlan` is
        copied grid by grid with the native loop (:mod:`~pd_transfer.transport.copy.grid`), its
        programs kept in ``programs`` (a link's, across rooms) when given.
        """
        where = where or f"plan {plan.src_rank} -> {plan.dst_rank}"
        if self.native and isinstance(plan, GridPlan):
            if grid.copy(plan, src_regions, dst_regions, {} if programs is None else programs):
                return plan.total_nbytes
            # a piece out of bounds: the full check below lowers the plan, names it and raises
        if plan.num_runs <= self.direct_max_runs:
            copies = _small_copies(plan, src_regions, dst_regions, self.native)
            if copies is not None:
                if self.native:
                    native_loop.copy_list(copies)
                else:
                    for dst, d, src, s, n in copies:
                        dst[d : d + n] = src[s : s + n]
                return plan.total_nbytes
            # a piece out of bounds: the vectorised check below names it and raises
        flat = flatten(plan)
        src = map_regions(src_regions, (b.src_region for b in flat.batches), "source")
        dst = map_regions(dst_regions, (b.dst_region for b in flat.batches), "destination")
        check_bounds(flat, sizes_of(src), sizes_of(dst), where)
        total = flat.total_nbytes
        parallel = self.num_workers > 1 and total >= self.inline_nbytes
        # threads finish in any order: the plan's last run (a room's aux row) is copied
        # after the rest, so that it still lands last
        last = len(flat.nbytes) - 1
        tail = parallel and last > 0 and int(flat.nbytes[last]) * int(flat.count[last]) <= LAST_RUN_NBYTES
        if self.native:
            self._native(flat.rows(slice(0, last)) if tail else flat, src, dst, parallel)
            if tail:
                self._native(flat.rows(slice(last, None)), src, dst, False)
            return total
        tasks = self._compile(flat.rows(slice(0, last)) if tail else flat, src, dst)
        if not parallel or len(tasks) < 2:
            self._drain(iter(tasks))
        else:
            self._parallel(tasks)
        if tail:
            self._drain(iter(self._compile(flat.rows(slice(last, None)), src, dst)))
        return total

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- run --------------------------------------------------------------------------
    def _compile(self, flat, src, dst) -> list:
        return compile_tasks(
            flat, src, dst, stretch_nbytes=self.stretch_nbytes, bounce_nbytes=self.bounce_nbytes
        )

    def _native(self, flat, src, dst, parallel: bool) -> None:
        pieces = native_loop.Pieces(flat, src, dst)
        if not parallel:
            pieces.copy()
            return
        first, *rest = pieces.ranges(self.num_workers)
        pool = self._workers()
        helpers = [pool.submit(pieces.copy, *part) for part in rest]
        try:
            pieces.copy(*first)
        finally:
            for helper in helpers:
                helper.result()

    def _parallel(self, tasks: list) -> None:
        """The calling thread and ``num_workers - 1`` pool threads take tasks in turn."""
        shared = iter(tasks)  # next() on a list iterator is atomic under the GIL
        pool = self._workers()
        helpers = [pool.submit(self._drain, shared) for _ in range(self.num_workers - 1)]
        try:
            self._drain(shared)
        finally:
            for helper in helpers:
                helper.result()

    def _drain(self, tasks: Iterator) -> None:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = BounceBuffer(self.bounce_nbytes + self.stretch_nbytes)
        for task in tasks:
            task.run(scratch)

    def _workers(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers - 1, thread_name_prefix="pdt-copy")
            return self._pool


def _small_copies(plan, src_regions: Regions, dst_regions: Regions, addresses: bool = False) -> list | None:
    """The copies of a plan of a few hundred runs, each bounds-checked in Python (a
    1-page room: 64 runs in 64 batches, where the vectorised path's per-batch numpy
    calls cost more than the copy), as ``(dst, dst_offset, src, src_offset, nbytes)``
    with arrays, or with ``addresses`` as ``dst_address, src_address, nbytes`` flat; None
    when a piece is out of bounds or a region is missing (the caller's full check
    raises with the details)."""
    copies: list[Any] = []
    append = copies.extend if addresses else copies.append
    for batch in plan.batches:
        src, dst = src_regions.get(batch.src_region), dst_regions.get(batch.dst_region)
        if src is None or dst is None:
            return None
        if src.__class__ is not Mapped:
            src = map_one(batch.src_region, src, "source")
        if dst.__class__ is not Mapped:
            dst = map_one(batch.dst_region, dst, "destination")
        base = (dst.address, src.address) if addresses else None
        src, dst = src.array, dst.array
        pieces: Iterable[tuple[int, int, int, int]]
        if len(batch.src_offset) == 1:  # one descriptor (a page of one layer): no lists
            pieces = (
                (batch.src_offset.item(), batch.dst_offset.item(), batch.nbytes.item(), batch.count.item()),
            )
        else:
            pieces = zip(
                batch.src_offset.tolist(),
                batch.dst_offset.tolist(),
                batch.nbytes.tolist(),
                batch.count.tolist(),
            )
        s_size, d_size = src.size, dst.size
        for s, d, n, c in pieces:
            if n < 0 or c < 0:
                return None
            if c == 1 and n:
                if s < 0 or d < 0 or s + n > s_size or d + n > d_size:
                    return None
                append((base[0] + d, base[1] + s, n) if base else (dst, d, src, s, n))
                continue
            s_stride, d_stride = batch.src_stride, batch.dst_stride
            for k in range(c) if n else ():
                s_k, d_k = s + k * s_stride, d + k * d_stride
                if s_k < 0 or d_k < 0 or s_k + n > s_size or d_k + n > d_size:
                    return None
                append((base[0] + d_k, base[1] + s_k, n) if base else (dst, d_k, src, s_k, n))
    return copies


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
