"""Transport throughput against the machine's own limits, measured in one run.

Moves one Llama-3.1-8B request of 8192 tokens (512 pages of 16 tokens, random
distinct pages of a 600-page pool on both sides, NHD pools, rank pair 0 -> 0):

  shm direct   prefill TP 2 -> decode TP 2: 64 layers x K/V, 16 KiB page runs (512 MiB)
  shm sliced   prefill TP 2 -> decode TP 4: each page row splits into 16 strided
               512-byte pieces (2 of the 4 KV heads per token), 256 MiB
beside a plain contiguous torch ``dst.copy_(src)`` of the same bytes (the
memory limit); and three tcp cases (:mod:`tcp_cases`: one 256 MiB block,
16,384 runs of 16 KiB at random pages, 65,536 pieces of 2 KiB of TP 2 -> 4
head slices), each through TcpTransport into a TcpReceiver in another
process, beside a raw loopback socket moving the same bytes between the same
two processes (``sendall`` of 1 MiB writes, ``recv_into`` a 4 MiB buffer: the
loopback limit). The pages case also goes through the ZeroMQ variant
(ZmqTcpTransport, the CURVE-capable path) for comparison.

Each figure is the median of ``--repeats`` runs; floor and case are timed
alternately so drift on a shared machine hits both, and a tcp ratio is the
median of the ratios of each floor run to the case run right after it.
Targets: shm direct >= 0.6x copy_, shm sliced >= 0.4x copy_, each tcp case
>= 0.7x raw socket. Also printed: the p50 time of a 1-page room over shm
(write call to return).

Run: ``python benchmarks/transport_bench.py [--repeats N]``. Needs ~4 GiB of
/dev/shm. No assertions: tests check correctness, this reports speed (after a
spot check that the bytes landed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_transfer.layout.geometry import RankGeometry, Role  # noqa: E402
from pd_transfer.layout.planner import plan_pair  # noqa: E402
from pd_transfer.layout.presets import load_preset  # noqa: E402
from pd_transfer.layout.rank_builder import build_instance  # noqa: E402
from pd_transfer.layout.reconcile import reconcile  # noqa: E402
from pd_transfer.layout.views import Layout, Pool  # noqa: E402
from pd_transfer.memory.segments import Segment, create_segment  # noqa: E402
from pd_transfer.transport import PeerEndpoint, ShmTransport  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tcp_cases  # noqa: E402

TOKENS, PAGE_SIZE, POOL_PAGES = 8192, 16, 600
MIB = 1 << 20
TCP_TARGET = 0.7


# -- set-up ------------------------------------------------------------------------------
def instance(role: Role, tp: int) -> list[RankGeometry]:
    return build_instance(
        load_preset("llama-3.1-8b"), role, tp, page_size=PAGE_SIZE, kv_layout=Layout.NHD, num_pages=POOL_PAGES
    )


def plan_for(decode_tp: int, src_pages: np.ndarray, dst_pages: np.ndarray):
    prefill, decode = instance(Role.PREFILL, 2), instance(Role.DECODE, decode_tp)
    plan = plan_pair(reconcile(prefill, decode), prefill[0], decode[0], {Pool.KV: (src_pages, dst_pages)})
    return plan, prefill[0], decode[0]


def make_segments(geometry: RankGeometry, tag: str, fill: str) -> dict[str, Segment]:
    out = {}
    for i, region in enumerate(geometry.regions):
        segment = create_segment(f"pdt-bench-{tag}-{i}", region.nbytes)
        if fill == "pattern":  # cheap, page-distinct content for the spot check
            pattern = np.arange(region.nbytes, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(i)
            segment.array[:] = (pattern >> np.uint32(13)).astype(np.uint8)
        else:
            segment.array[:] = 0  # touch every page: real pools are resident
        out[region.id] = segment
    return out


def regions_of(segments: dict[str, Segment]) -> dict[str, torch.Tensor]:
    return {region_id: segment.tensor for region_id, segment in segments.items()}


def spot_check(plan, src: dict[str, Segment], dst: dict[str, Segment], label: str) -> None:
    rng = np.random.default_rng(1)
    for batch in rng.choice(len(plan.batches), 8, replace=False):
        b = plan.batches[int(batch)]
        s, d, n = b.byte_runs()
        for i in rng.choice(len(n), min(16, len(n)), replace=False):
            want = src[b.src_region].array[s[i] : s[i] + n[i]]
            if not np.array_equal(dst[b.dst_region].array[d[i] : d[i] + n[i]], want):
                raise SystemExit(f"{label}: bytes did not land (batch {batch}, run {i})")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(floor_fn, case_fn, repeats: int) -> tuple[float, float]:
    """Median seconds of the floor and of the case, timed in turns."""
    floors, cases = [], []
    floor_fn(), case_fn()  # warm up
    for _ in range(repeats):
        floors.append(timed(floor_fn))
        cases.append(timed(case_fn))
    return statistics.median(floors), statistics.median(cases)


# -- shm -----------------------------------------------------------------------------------
def shm_writer(plan, src: dict[str, Segment], dst: dict[str, Segment]):
    transport = ShmTransport()
    loop = asyncio.new_event_loop()
    endpoint = PeerEndpoint.from_maps(
        plan.dst_rank, {r: s.nbytes for r, s in dst.items()}, {r: s.name for r, s in dst.items()}
    )
    link = loop.run_until_complete(transport.connect(endpoint))
    regions = regions_of(src)

    def write() -> None:
        loop.run_until_complete(transport.write(link, plan, regions))

    return write, lambda: (loop.run_until_complete(transport.close()), loop.close())


def one_page_latency_us(src: dict[str, Segment], dst: dict[str, Segment], repeats: int = 200) -> float:
    plan, _, _ = plan_for(2, np.array([7]), np.array([9]))
    write, done = shm_writer(plan, src, dst)
    samples = [timed(write) for _ in range(repeats)]
    done()
    return statistics.median(samples) * 1e6


# -- report --------------------------------------------------------------------------------
def row(label: str, nbytes: int, seconds: float, ratio: str = "", target: str = "", verdict: str = "") -> str:
    return (
        f"{label:<44} {nbytes / MIB:>7.0f} MiB {seconds * 1e3:>9.1f} "
        f"{nbytes / seconds / 1e9:>7.2f}  {ratio:>10} {target:>8} {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--only", choices=("all", "shm", "tcp"), default="all", help="run one part (for iterating on it)"
    )
    parser.add_argument(
        "--zmq",
        choices=("pages", "all", "none"),
        default="pages",
        help="tcp cases also run over the ZeroMQ variant (before/after)",
    )
    args = parser.parse_args()
    print(
        f"median of {args.repeats}, {os.cpu_count()} CPUs; floor and case timed in turns "
        f"(tcp ratio: median of the per-turn ratios)"
    )
    print(f"{'case':<44} {'bytes':>11} {'ms':>9} {'GB/s':>7}  {'ratio':>10} {'target':>8}")
    if args.only in ("all", "tcp"):
        print("\n".join(tcp_report(args.repeats, args.zmq)), flush=True)
    if args.only in ("all", "shm"):
        shm_main(args.repeats)


def tcp_report(repeats: int, zmq: str = "pages") -> list[str]:
    tag = uuid.uuid4().hex[:6]
    bench = tcp_cases.Bench(tcp_cases.cases(), tag)
    lines = []
    try:
        for name, case in bench.cases.items():
            raw_s, tcp_s, ratio = bench.alternate(name, repeats)
            bench.spot_check(name)
            n = case.plan.total_nbytes
            lines.append(row(f"floor: raw loopback socket, {n // MIB} MiB", n, raw_s))
            lines.append(
                row(
                    f"tcp {case.label}",
                    n,
                    tcp_s,
                    f"{ratio:.2f}x raw",
                    f">= {TCP_TARGET}x",
                    "met" if ratio >= TCP_TARGET else "MISSED",
                )
            )
            if zmq == "all" or zmq == name:  # timed in turns with a floor of its own
                raw_s, zmq_s, zmq_ratio = bench.alternate(name, repeats, "zmq")
                lines.append(row("  floor again, in turns with the ZeroMQ row", n, raw_s))
                lines.append(
                    row(
                        "  same over ZeroMQ (the CURVE variant)",
                        n,
                        zmq_s,
                        f"{zmq_ratio:.2f}x raw",
                        "-",
                        "(reference)",
                    )
                )
    finally:
        refused = bench.close()
    if refused:
        raise SystemExit(f"tcp receivers refused {refused} frames")
    return lines


def shm_main(repeats: int) -> None:
    rng = np.random.default_rng(0)
    pages = TOKENS // PAGE_SIZE
    src_pages, dst_pages = rng.permutation(POOL_PAGES)[:pages], rng.permutation(POOL_PAGES)[:pages]
    direct, prefill0, decode_direct = plan_for(2, src_pages, dst_pages)
    sliced, _, decode_sliced = plan_for(4, src_pages, dst_pages)
    tag = uuid.uuid4().hex[:6]
    made: list[dict[str, Segment]] = []
    try:
        src = make_segments(prefill0, f"{tag}-src", "pattern")
        dst_direct = make_segments(decode_direct, f"{tag}-dd", "zero")
        dst_sliced = make_segments(decode_sliced, f"{tag}-ds", "zero")
        made += [src, dst_direct, dst_sliced]
        shm_report(repeats, direct, sliced, src, dst_direct, dst_sliced)
    finally:
        for segments in made:
            for segment in segments.values():
                segment.close()
                segment.unlink()


def shm_report(repeats: int, direct, sliced, src, dst_direct, dst_sliced) -> None:
    floor_src = torch.empty(direct.total_nbytes, dtype=torch.uint8).fill_(1)
    floor_dst = torch.zeros(direct.total_nbytes, dtype=torch.uint8)
    lines = []
    shm_cases = (
        ("shm direct  TP 2->2 (16 KiB page runs)", direct, dst_direct, 0.6),
        ("shm sliced  TP 2->4 (512 B strided pieces)", sliced, dst_sliced, 0.4),
    )
    for label, plan, dst, target in shm_cases:
        n = plan.total_nbytes
        write, done = shm_writer(plan, src, dst)
        floor_s, case_s = alternate(lambda n=n: floor_dst[:n].copy_(floor_src[:n]), write, repeats)
        done()
        spot_check(plan, src, dst, label)
        ratio = floor_s / case_s
        lines.append(row(f"floor: torch copy_ (contiguous) {n // MIB} MiB", n, floor_s))
        lines.append(
            row(
                label,
                n,
                case_s,
                f"{ratio:.2f}x copy",
                f">= {target}x",
                "met" if ratio >= target else "MISSED",
            )
        )
    latency = one_page_latency_us(src, dst_direct)
    print(
        f"Llama-3.1-8B, {TOKENS} tokens = {TOKENS // PAGE_SIZE} pages of {PAGE_SIZE}, random "
        f"distinct pages of a {POOL_PAGES}-page pool, rank pair 0 -> 0"
    )
    print("\n".join(lines))
    print(f"shm 1-page room (64 runs of 16 KiB), write() p50: {latency:.0f} us")


if __name__ == "__main__":
    main()
