"""The short probe behind the strategy choice: what moving bytes to one peer costs.

:func:`measure_path` times, at connect, a few engine submissions into our own
remote staging slot (decode scatters nothing it was not told about), a numpy
gather on this host and an empty staged round trip, and returns the
:class:`~pd_transfer.transport.engines.strategy.PathCost` that :mod:`~pd_transfer.transport.engines.strategy` turns into a crossover run
size. Blocking calls throughout: run in a worker thread.
"""

from __future__ import annotations

import functools
import mmap
import time
from collections.abc import Callable

import numpy as np

from pd_transfer.transport.copy.packing import gather_pieces
from pd_transfer.transport.engines.staging.sender import StagingChannel, Submit
from pd_transfer.transport.engines.strategy import PathCost
from pd_transfer.transport.regions import Mapped

_TINY_NBYTES = 64
_RUN_NBYTES = 4096
_MAX_PROBE_RUNS = 256
_COPY_SOURCE_NBYTES = 48 << 20  # 12 windows of 4 MiB, larger than most last-level caches
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
    per_descriptor = max(
        _descriptor_cost(channel, submit, run_nbytes, repeats, one)
        for run_nbytes in (_TINY_NBYTES, _RUN_NBYTES)
    )
    ring = range(len(channel.slots))

    def fill_ring() -> None:
        for i in ring:
            submit([channel.local_addr(i)], [channel.remote_addr(i)], [channel.slot_nbytes])

    bulk = _best(min(repeats, 2), fill_ring)
    bulk_nbytes = len(ring) * channel.slot_nbytes
    copy_bps, per_run = copy_cost()
    round_trip = _best(repeats, channel.empty_round_trip)
    return PathCost(
        fixed_s=one,
        per_descriptor_s=per_descriptor,
        engine_bytes_per_s=bulk_nbytes / max(bulk - len(ring) * one, bulk / 2, 1e-6),
        copy_bytes_per_s=copy_bps,
        copy_per_run_s=per_run,
        round_trip_s=round_trip,
    )


def _descriptor_cost(
    channel: StagingChannel, submit: Submit, run_nbytes: int, repeats: int, one_tiny_s: float
) -> float:
    """Seconds each further descriptor of ``run_nbytes`` adds to a submission: many such
    runs against their bytes as one run (tiny runs: against one tiny descriptor)."""
    local, remote = channel.local_addr(0), channel.remote_addr(0)
    num = max(2, min(_MAX_PROBE_RUNS, channel.slot_nbytes // (2 * run_nbytes)))
    offsets = [k * 2 * run_nbytes for k in range(num)]  # every other run: nothing joins
    many = _best(
        repeats,
        lambda: submit([local + o for o in offsets], [remote + o for o in offsets], [run_nbytes] * num),
    )
    same = (
        one_tiny_s
        if run_nbytes == _TINY_NBYTES
        else _best(repeats, lambda: submit([local], [remote], [num * run_nbytes]))
    )
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
