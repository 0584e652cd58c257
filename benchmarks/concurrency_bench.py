"""Many rooms of mixed sizes across several decode peers: latency and head-of-line blocking.

    python benchmarks/concurrency_bench.py [--rooms 1000] [--decode-peers 4] [--transport shm]

One prefill sidecar (Llama-3.1-8B, TP 1, page 16: 2 MiB of KV per page)
feeds ``--decode-peers`` decode instances (TP 1 each, their own sidecars).
The benchmark process plays every worker with asyncio clients and keeps
``--window`` rooms in flight; each room goes to a random decode peer and is
small (1-4 pages) or, with probability ``--large-share``, large
(``--large-pages`` pages). A room's latency runs from the prefill worker's
send() to its decode worker seeing Success. Prints p50/p99 for all rooms,
for small rooms, and for small rooms that started while a large room was in
flight (head-of-line blocking shows there), each peer's share of rooms and
bytes, and the peak resident memory of every sidecar. No assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cluster import Cluster  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Driver:
    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster, self.args = cluster, args
        self.rng = np.random.default_rng(args.seed)
        self.large_in_flight = 0
        self.results: list[tuple[int, bool, bool, float, str]] = []  # peer, large, contended, s, status
        self.free_src = list(range(args.pages))
        self.free_dst = [list(range(args.pages)) for _ in cluster.decodes]
        self.page_freed = asyncio.Condition()

    async def run(self) -> float:
        self.clients = self.cluster.async_clients()
        self.prefill = self.clients[self.cluster.names("p")[0]]
        self.decode = [self.clients[self.cluster.names("d", i)[0]] for i in range(len(self.cluster.decodes))]
        await self._room(0, 0, 1, large=False, record=False)  # warm-up: bootstrap and verdicts
        for peer in range(1, len(self.decode)):
            await self._room(peer, peer, 1, large=False, record=False)
        window = asyncio.Semaphore(self.args.window)
        started = time.perf_counter()

        async def one(room: int) -> None:
            async with window:
                large = bool(self.rng.random() < self.args.large_share)
                pages = self.args.large_pages if large else int(self.rng.integers(1, 5))
                peer = int(self.rng.integers(len(self.decode)))
                await self._room(peer, 1000 + room, pages, large=large, record=True)

        await asyncio.gather(*(one(i) for i in range(self.args.rooms)))
        elapsed = time.perf_counter() - started
        for client in self.clients.values():
            client.close()
        return elapsed

    async def _take(self, pool: list[int], n: int) -> list[int]:
        async with self.page_freed:
            await self.page_freed.wait_for(lambda: len(pool) >= n)
            picked = [pool.pop(int(self.rng.integers(len(pool)))) for _ in range(n)]
        return picked

    async def _give(self, pool: list[int], pages: list[int]) -> None:
        async with self.page_freed:
            pool.extend(pages)
            self.page_freed.notify_all()

    async def _room(self, peer: int, room: int, pages: int, *, large: bool, record: bool) -> None:
        src = await self._take(self.free_src, pages)
        dst = await self._take(self.free_dst[peer], pages)
        try:
            await self.decode[peer].expect(room, self.cluster.bootstrap, dst, aux_row=room % 64)
            contended = self.large_in_flight > 0 and not large
            self.large_in_flight += large
            start = time.perf_counter()
            await self.prefill.send(room, src, aux_row=room % 64)
            state = await self.decode[peer].wait(room, 120)
            seconds = time.perf_counter() - start
            self.large_in_flight -= large
            if record:
                self.results.append((peer, large, contended, seconds, state.status.value))
        finally:
            await self._give(self.free_src, src)
            await self._give(self.free_dst[peer], dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, default=1000)
    parser.add_argument("--decode-peers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32, help="rooms in flight at most")
    parser.add_argument("--large-share", type=float, default=0.05)
    parser.add_argument("--large-pages", type=int, default=128, help="256 MiB of KV at TP 1")
    parser.add_argument("--pages", type=int, default=640, help="pool pages per rank")
    parser.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="pdt-conc-"))
    cluster = Cluster(workdir, num_decode=args.decode_peers, num_pages=args.pages, transport=args.transport)
    try:
        driver = Driver(cluster, args)
        elapsed = asyncio.run(driver.run())
        rss = cluster.peak_rss()
    finally:
        cluster.close()
    report(args, driver.results, elapsed, rss)


def report(args, results, elapsed: float, rss: dict[str, float]) -> None:
    page_mib = 2  # Llama-3.1-8B, TP 1, page 16
    ok = [r for r in results if r[4] == "success"]
    print(
        f"Llama-3.1-8B TP 1 -> {args.decode_peers} decode peers (TP 1), {args.transport}, "
        f"{args.rooms} rooms, window {args.window}, large rooms {args.large_share:.0%} of "
        f"{args.large_pages} pages ({args.large_pages * page_mib} MiB), small 1-4 pages"
    )
    print(
        f"rooms succeeded {len(ok)} / {len(results)} in {elapsed:.1f} s "
        f"({len(results) / elapsed:.0f} rooms/s)"
    )
    print(f"{'rooms':<36}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}")
    for label, rows in [
        ("all", ok),
        ("small", [r for r in ok if not r[1]]),
        ("small, a large room in flight", [r for r in ok if r[2]]),
        ("large", [r for r in ok if r[1]]),
    ]:
        ms = [r[3] * 1e3 for r in rows]
        print(f"{label:<36}{len(rows):>7}{_pct(ms, 50):>10.1f}{_pct(ms, 99):>10.1f}")
    shares = []
    for peer in range(args.decode_peers):
        rows = [r for r in ok if r[0] == peer]
        shares.append(
            f"peer {peer}: {len(rows)} rooms, median {statistics.median([r[3] for r in rows]) * 1e3:.1f} ms"
            if rows
            else f"peer {peer}: 0 rooms"
        )
    print("per peer: " + "; ".join(shares))
    print(
        "peak RSS per sidecar (MiB, shared-memory pages it touched included): "
        + ", ".join(f"{name} {mib:.0f}" for name, mib in sorted(rss.items()))
    )


if __name__ == "__main__":
    main()
