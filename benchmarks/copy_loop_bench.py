"""The copy engine with its native loop and with numpy, against a contiguous copy.

    python benchmarks/copy_loop_bench.py [--repeats 7]

In one process, on the engines bench's three cases (one 256 MiB block;
16,384 pieces of 16 KiB and 65,536 of 2 KiB at random slots of a 256 MiB
source, landing at random slots of a 512 MiB destination): the median
seconds of ``CopyEngine.execute`` with ``native=False`` (numpy tasks) and
``native=True`` (the C loop), each as a ratio of a plain contiguous torch
``copy_`` of 256 MiB measured in the same run (the memory floor). Then a
1-page Llama room's copy (64 runs of 32 KiB, one per K/V tensor of 32
layers, a different page each time): p50 microseconds back to back and after
50 ms of idle. Checks the landed bytes once per path; no assertion on speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_transfer.layout.lowering import RunBatch, TransferPlan  # noqa: E402
from pd_transfer.transport.copy import native_loop  # noqa: E402
from pd_transfer.transport.copy.copy_engine import CopyEngine  # noqa: E402
from pd_transfer.transport.regions import Mapped  # noqa: E402

MIB = 1 << 20
CASES = (
    ("one 256 MiB block", 256 * MIB, 1),
    ("16,384 x 16 KiB", 16 << 10, 16384),
    ("65,536 x 2 KiB", 2 << 10, 65536),
)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_page_us(engine: CopyEngine, regions, rooms: int = 60) -> tuple[float, float]:
    """p50 us of a 1-page room's copy: back to back, and each after 50 ms idle."""

    def plan(i: int) -> TransferPlan:
        src_page, dst_page = i % 64, (i * 7) % 64
        return TransferPlan(
            "p",
            "d",
            tuple(
                RunBatch(
                    "s",
                    "d",
                    np.array([t * 2 * MIB + src_page * 32768]),
                    np.array([t * 2 * MIB + dst_page * 32768]),
                    np.array([32768]),
                    np.array([1]),
                    0,
                    0,
                )
                for t in range(64)
            ),
        )

    plans = [plan(i) for i in range(rooms)]
    out = []
    for idle_s in (0.0, 0.05):
        times = []
        for p in plans:
            time.sleep(idle_s)
            start = time.perf_counter()
            engine.execute(p, *regions)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times[5:]) * 1e6)
    (src,), (dst,) = (r.values() for r in regions)
    for batch in plans[-1].batches:
        s, d = int(batch.src_offset[0]), int(batch.dst_offset[0])
        if not np.array_equal(dst.array[d : d + 32768], src.array[s : s + 32768]):
            raise SystemExit("1-page room: destination bytes are wrong")
    return out[0], out[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    src = np.frombuffer(rng.bytes(256 * MIB), np.uint8).copy()
    dst = np.ones(512 * MIB, np.uint8)  # touched: no page faults in the timing
    regions = ({"s": Mapped("s", src)}, {"d": Mapped("d", dst)})
    a, b = torch.ones(256 * MIB, dtype=torch.uint8), torch.zeros(256 * MIB, dtype=torch.uint8)
    floor = 256 * MIB / timed(lambda: b.copy_(a), args.repeats) / 1e9
    paths = [("numpy", False)] + ([("native", True)] if native_loop.AVAILABLE else [])
    print(
        f"median of {args.repeats}, one process; floor: torch copy_ of 256 MiB, {floor:.2f} GB/s"
        + ("" if native_loop.AVAILABLE else f"; native loop unavailable: {native_loop.UNAVAILABLE_WHY}")
    )
    print(f"{'case':<20}{'path':<8}{'ms':>8}{'GB/s':>8}{'x copy_':>9}")
    for title, run, count in CASES:
        s = rng.permutation(256 * MIB // run)[:count].astype(np.int64) * run
        d = rng.permutation(512 * MIB // run)[:count].astype(np.int64) * run
        plan = TransferPlan(
            "p",
            "d",
            (RunBatch("s", "d", s, d, np.full(count, run, np.int64), np.ones(count, np.int64), 0, 0),),
        )
        rows = np.dtype((np.void, run))
        for name, native in paths:
            engine = CopyEngine(native=native)
            dst[:] = 1
            seconds = timed(lambda e=engine, p=plan: e.execute(p, *regions), args.repeats)
            if not np.array_equal(dst.view(rows)[d // run], src.view(rows)[s // run]):
                raise SystemExit(f"{title}, {name}: destination bytes are wrong")
            rate = run * count / seconds / 1e9
            print(f"{title:<20}{name:<8}{seconds * 1e3:>8.1f}{rate:>8.2f}{rate / floor:>9.2f}")
    print("1-page room (64 runs of 32 KiB), p50 us: back to back / after 50 ms idle")
    for name, native in paths:
        warm, cold = one_page_us(CopyEngine(native=native), regions)
        print(f"{'':<20}{name:<8}{warm:>8.0f} / {cold:.0f}")


if __name__ == "__main__":
    main()
