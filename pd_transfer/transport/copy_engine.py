"""The copy engine: executes a transfer plan between two sets of mapped regions.

``CopyEngine.execute(plan, src_regions, dst_regions)`` first bounds-checks
*every* piece of the plan against both sides (one vectorised pass over all
descriptors, :mod:`.runs`); if any piece is out of bounds it raises a
:class:`TransportError` and copies nothing. Then it copies:

- plans of a few hundred runs (a 1-page room) are copied run by run with
  numpy slices on the calling thread: lowest latency;
- larger plans are compiled into tasks (:mod:`.copy_tasks`): long destination
  stretches are filled in one pass, short runs go through a bounce buffer
  (gather by source rows, scatter by destination rows), about one task per
  megabyte, taken in turn by the calling thread and the engine's workers.

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from pd_transfer.transport.copy_tasks import Scratch, compile_tasks
from pd_transfer.transport.regions import Mapped, Regions, map_regions, sizes_of
from pd_transfer.transport.runs import Runs, check_bounds, expand, flatten


class CopyEngine:
    """Executes plans between mapped regions. Thread-safe; share one per process.

    ``num_workers`` threads (default: up to 2, the CPUs this process may use;
    the calling thread counts as one) copy the tasks of a plan of more than
    ``inline_nbytes``; smaller plans run in the calling thread alone.
    """

    def __init__(self, *, num_workers: int | None = None, bounce_nbytes: int = 1 << 20,
                 stretch_nbytes: int = 128 << 10, inline_nbytes: int = 4 << 20,
                 direct_max_runs: int = 256) -> None:
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
        tasks = compile_tasks(flat, src, dst, stretch_nbytes=self.stretch_nbytes,
                              bounce_nbytes=self.bounce_nbytes)
        if self.num_workers == 1 or flat.total_nbytes < self.inline_nbytes or len(tasks) < 2:
            self._drain(iter(tasks))
        else:
            self._parallel(tasks)
        return flat.total_nbytes

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- run --------------------------------------------------------------------------
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
            scratch = self._local.scratch = Scratch(self.bounce_nbytes + self.stretch_nbytes)
        for task in tasks:
            task.run(scratch)

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
