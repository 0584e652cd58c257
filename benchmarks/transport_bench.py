"""Transport throughput against the machine's own limits, measured in one run.

Moves one Llama-3.1-8B request of 8192 tokens (512 pages of 16 tokens, random
distinct pages of a 600-page pool on both sides, NHD pools, rank pair 0 -> 0):

  shm direct   prefill TP 2 -> decode TP 2: 64 layers x K/V, 16 KiB page runs (512 MiB)
  shm sliced   prefill TP 2 -> decode TP 4: each page row splits into 16 strided
               512-byte pieces (2 of the 4 KV heads per token), 256 MiB
  tcp direct   the direct plan through TcpTransport into a TcpReceiver running in
               another process (loopback)

beside the floors, on the same bytes, in the same run:

  copy_        a plain contiguous torch ``dst.copy_(src)`` (the memory limit)
  raw socket   a plain Python TCP stream between two processes on 127.0.0.1,
               ``sendall`` of 1 MiB writes, ``recv_into`` on the other side
               (the loopback limit)

Each figure is the median of ``--repeats`` runs; copy_ and the engine are timed
alternately so drift on a shared machine hits both. Targets: shm direct >= 0.6x
copy_, shm sliced >= 0.4x copy_, tcp >= 0.6x raw socket. Also printed: the p50
time of a 1-page room over shm (write call to return).

Run: ``python benchmarks/transport_bench.py [--repeats N]``. Needs ~4 GiB of
/dev/shm. No assertions: tests check correctness, this reports speed (after a
spot check that the bytes landed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
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
from pd_transfer.shm import Segment, create_segment, open_segment  # noqa: E402
from pd_transfer.transport import (  # noqa: E402
    PeerEndpoint,
    ShmTransport,
    TcpReceiver,
    TcpTransport,
)

TOKENS, PAGE_SIZE, POOL_PAGES = 8192, 16, 600
MIB = 1 << 20
RAW_WRITE_NBYTES = 1 * MIB


# -- set-up ------------------------------------------------------------------------------
def instance(role: Role, tp: int) -> list[RankGeometry]:
    return build_instance(load_preset("llama-3.1-8b"), role, tp, page_size=PAGE_SIZE,
                          kv_layout=Layout.NHD, num_pages=POOL_PAGES)


def plan_for(decode_tp: int, src_pages: np.ndarray, dst_pages: np.ndarray):
    prefill, decode = instance(Role.PREFILL, 2), instance(Role.DECODE, decode_tp)
    plan = plan_pair(reconcile(prefill, decode), prefill[0], decode[0],
                     {Pool.KV: (src_pages, dst_pages)})
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
            want = src[b.src_region].array[s[i]:s[i] + n[i]]
            if not np.array_equal(dst[b.dst_region].array[d[i]:d[i] + n[i]], want):
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


# -- raw loopback socket floor --------------------------------------------------------------
def _raw_receiver(port_queue, total_nbytes: int, repeats: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(bytearray(4 * MIB))
    for _ in range(repeats + 1):
        left = total_nbytes
        while left:
            got = conn.recv_into(buf, min(left, len(buf)))
            if not got:
                return
            left -= got
        conn.sendall(b"k")
    conn.close()


def raw_socket_seconds(total_nbytes: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_raw_receiver, args=(ports, total_nbytes, repeats), daemon=True)
    child.start()
    conn = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
    chunk = memoryview(np.random.default_rng(0).integers(0, 256, RAW_WRITE_NBYTES, np.uint8))

    def once() -> None:
        left = total_nbytes
        while left:
            n = min(left, RAW_WRITE_NBYTES)
            conn.sendall(chunk[:n])
            left -= n
        if conn.recv(1) != b"k":
            raise SystemExit("raw socket receiver went away")

    once()
    seconds = statistics.median(timed(once) for _ in range(repeats))
    conn.close()
    child.join(10)
    return seconds


# -- tcp transport into a receiver process ---------------------------------------------------
def _tcp_receiver(names: dict[str, str], pipe) -> None:
    async def serve() -> None:
        regions = {r: open_segment(name).tensor for r, name in names.items()}
        receiver = TcpReceiver("127.0.0.1", regions)
        pipe.send(await receiver.start())
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # stop signal
        pipe.send((receiver.stats.chunks_landed, receiver.stats.frames_refused))
        await receiver.stop()
    asyncio.run(serve())


def tcp_seconds(plan, src: dict[str, Segment], dst: dict[str, Segment], repeats: int) -> float:
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_tcp_receiver, args=({r: s.name for r, s in dst.items()}, child_end),
                        daemon=True)
    child.start()
    address = parent_end.recv()

    async def run() -> list[float]:
        transport = TcpTransport()
        link = await transport.connect(PeerEndpoint.from_maps(
            plan.dst_rank, {r: s.nbytes for r, s in dst.items()}, data_address=address))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            await transport.write(link, plan, regions_of(src), room="bench")
            times.append(time.perf_counter() - start)
        await transport.close()
        return times[1:]

    times = asyncio.run(run())
    parent_end.send("stop")
    _, refused = parent_end.recv()
    child.join(10)
    if refused:
        raise SystemExit(f"tcp receiver refused {refused} frames")
    return statistics.median(times)


# -- shm -----------------------------------------------------------------------------------
def shm_writer(plan, src: dict[str, Segment], dst: dict[str, Segment]):
    transport = ShmTransport()
    loop = asyncio.new_event_loop()
    endpoint = PeerEndpoint.from_maps(plan.dst_rank, {r: s.nbytes for r, s in dst.items()},
                                      {r: s.name for r, s in dst.items()})
    link = loop.run_until_complete(transport.connect(endpoint))
    regions = regions_of(src)

    def write() -> None:
        loop.run_until_complete(transport.write(link, plan, regions))
    return write, lambda: (loop.run_until_complete(transport.close()), loop.close())


def one_page_latency_us(src: dict[str, Segment], dst: dict[str, Segment],
                        repeats: int = 200) -> float:
    plan, _, _ = plan_for(2, np.array([7]), np.array([9]))
    write, done = shm_writer(plan, src, dst)
    samples = [timed(write) for _ in range(repeats)]
    done()
    return statistics.median(samples) * 1e6


# -- report --------------------------------------------------------------------------------
def row(label: str, nbytes: int, seconds: float, ratio: str = "", target: str = "",
        verdict: str = "") -> str:
    return (f"{label:<44} {nbytes / MIB:>7.0f} MiB {seconds * 1e3:>9.1f} "
            f"{nbytes / seconds / 1e9:>7.2f}  {ratio:>10} {target:>8} {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=("all", "shm", "tcp"), default="all",
                        help="run one part (for iterating on it)")
    args = parser.parse_args()
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
        dst_tcp = make_segments(decode_direct, f"{tag}-dt", "zero")
        made += [src, dst_direct, dst_sliced, dst_tcp]
        report(args.repeats, args.only, direct, sliced, src, dst_direct, dst_sliced, dst_tcp)
    finally:
        for segments in made:
            for segment in segments.values():
                segment.close()
                segment.unlink()


def report(repeats: int, only: str, direct, sliced, src, dst_direct, dst_sliced, dst_tcp) -> None:
    floor_src = torch.empty(direct.total_nbytes, dtype=torch.uint8).fill_(1)
    floor_dst = torch.zeros(direct.total_nbytes, dtype=torch.uint8)
    lines = []
    shm_cases = (("shm direct  TP 2->2 (16 KiB page runs)", direct, dst_direct, 0.6),
                 ("shm sliced  TP 2->4 (512 B strided pieces)", sliced, dst_sliced, 0.4))
    for label, plan, dst, target in shm_cases if only in ("all", "shm") else ():
        n = plan.total_nbytes
        write, done = shm_writer(plan, src, dst)
        floor_s, case_s = alternate(lambda n=n: floor_dst[:n].copy_(floor_src[:n]), write, repeats)
        done()
        spot_check(plan, src, dst, label)
        ratio = floor_s / case_s
        lines.append(row(f"floor: torch copy_ (contiguous) {n // MIB} MiB", n, floor_s))
        lines.append(row(label, n, case_s, f"{ratio:.2f}x copy", f">= {target}x",
                         "met" if ratio >= target else "MISSED"))
    if only in ("all", "tcp"):
        raw_s = raw_socket_seconds(direct.total_nbytes, repeats)
        tcp_s = tcp_seconds(direct, src, dst_tcp, repeats)
        spot_check(direct, src, dst_tcp, "tcp")
        tcp_ratio = raw_s / tcp_s
        lines.append(row("floor: raw loopback socket (1 MiB sendall)", direct.total_nbytes, raw_s))
        lines.append(row("tcp direct  TP 2->2 (receiver process)", direct.total_nbytes, tcp_s,
                         f"{tcp_ratio:.2f}x raw", ">= 0.6x",
                         "met" if tcp_ratio >= 0.6 else "MISSED"))
    latency = one_page_latency_us(src, dst_direct)
    print(f"Llama-3.1-8B, {TOKENS} tokens = {TOKENS // PAGE_SIZE} pages of {PAGE_SIZE}, random "
          f"distinct pages of a {POOL_PAGES}-page pool, rank pair 0 -> 0, median of {repeats}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'case':<44} {'bytes':>11} {'ms':>9} {'GB/s':>7}  {'ratio':>10} {'target':>8}")
    print("\n".join(lines))
    print(f"shm 1-page room (64 runs of 16 KiB), write() p50: {latency:.0f} us")


if __name__ == "__main__":
    main()
