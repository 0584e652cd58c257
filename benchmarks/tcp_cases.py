"""The tcp cases of ``transport_bench.py``: plans, a receiver process, the raw-socket floor.

Three plans, each moved by ``TcpTransport`` into a ``TcpReceiver`` in another
process over loopback, and timed in turns with a raw loopback socket moving
the same number of bytes between the same two processes (``sendall`` of
1 MiB writes, ``recv_into`` a 4 MiB buffer on the other side):

  block    one 256 MiB run
  pages    16,384 runs of 16 KiB at random pages of a 20,000-page pool (256 MiB)
  heads    65,536 pieces of 2 KiB (head slices, TP 2 -> 4): 4,096 random pages
           of 16 tokens; each token's source row is 4 KiB (16 heads x 128 x
           bf16), decode takes its first 2 KiB, back to back in a 32 KiB page

Optionally the same plan through the ZeroMQ variant (``ZmqTcpTransport``,
the CURVE-capable path, without CURVE) for comparison.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.memory.segments import Segment, create_segment, open_segment
from pd_transfer.transport import (
    PeerEndpoint,
    TcpReceiver,
    TcpTransport,
    ZmqTcpReceiver,
    ZmqTcpTransport,
)

MIB = 1 << 20
RAW_WRITE_NBYTES = 1 * MIB
RAW_RECV_NBYTES = 4 * MIB


@dataclass
class Case:
    name: str
    label: str
    plan: TransferPlan
    src_nbytes: int
    dst_nbytes: int


def _one(src_region, dst_region, src, dst, nbytes, count=1, src_stride=0, dst_stride=0):
    n = len(src)
    return RunBatch(
        src_region,
        dst_region,
        np.asarray(src, np.int64),
        np.asarray(dst, np.int64),
        np.full(n, nbytes, np.int64),
        np.full(n, count, np.int64),
        src_stride,
        dst_stride,
    )


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    block = TransferPlan("p0", "d0", (_one("src", "dst", [0], [0], 256 * MIB),))
    pool, page = 20_000, 16 << 10
    src_pages, dst_pages = rng.permutation(pool)[:16_384], rng.permutation(pool)[:16_384]
    pages = TransferPlan("p0", "d0", (_one("src", "dst", src_pages * page, dst_pages * page, page),))
    # a source page: 16 tokens x 4 KiB; decode's page: 16 tokens x 2 KiB (its half of the heads)
    head_pool, token_row, piece = 5_000, 4 << 10, 2 << 10
    src_heads, dst_heads = rng.permutation(head_pool)[:4096], rng.permutation(head_pool)[:4096]
    heads = TransferPlan(
        "p0",
        "d0",
        (
            _one(
                "src", "dst", src_heads * 16 * token_row, dst_heads * 16 * piece, piece, 16, token_row, piece
            ),
        ),
    )
    return [
        Case("block", "one 256 MiB block", block, 256 * MIB, 256 * MIB),
        Case("pages", "16384 runs of 16 KiB, random pages", pages, pool * page, pool * page),
        Case(
            "heads",
            "65536 pieces of 2 KiB (TP 2->4 heads)",
            heads,
            head_pool * 16 * token_row,
            head_pool * 16 * piece,
        ),
    ]


# -- the receiver process: a raw sink and the receivers ---------------------------------
def _raw_sink(server: socket.socket) -> None:
    conn, _ = server.accept()
    buf = memoryview(bytearray(RAW_RECV_NBYTES))
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            return
        left = int.from_bytes(header, "little")
        while left:
            got = conn.recv_into(buf, min(left, len(buf)))
            if not got:
                return
            left -= got
        conn.sendall(b"k")


def _serve(names: dict[str, str], pipe) -> None:
    async def serve() -> None:
        server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_raw_sink, args=(server,), daemon=True).start()
        regions = {name: {"dst": open_segment(segment).tensor} for name, segment in names.items()}
        receivers = {name: TcpReceiver("127.0.0.1", r) for name, r in regions.items()}
        receivers.update({f"zmq-{name}": ZmqTcpReceiver("127.0.0.1", r) for name, r in regions.items()})
        addresses = {name: await r.start() for name, r in receivers.items()}
        pipe.send((server.getsockname()[1], addresses))
        await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # stop signal
        pipe.send(sum(r.stats.frames_refused for r in receivers.values()))
        for receiver in receivers.values():
            await receiver.stop()

    asyncio.run(serve())


class Bench:
    """Sender side: one event loop, links to the receiver process, a raw socket to its sink."""

    def __init__(self, cases_: list[Case], tag: str) -> None:
        self.cases = {c.name: c for c in cases_}
        self.src: dict[str, np.ndarray] = {}
        self.dst: dict[str, Segment] = {}
        rng = np.random.default_rng(1)
        for case in cases_:
            self.src[case.name] = rng.integers(0, 256, case.src_nbytes, np.uint8)
            self.dst[case.name] = create_segment(f"pdt-bench-{tag}-{case.name}", case.dst_nbytes)
            self.dst[case.name].array[:] = 0  # resident, as a real pool is
        ctx = mp.get_context("spawn")
        self.pipe, child_end = ctx.Pipe()
        self.child = ctx.Process(
            target=_serve, args=({n: s.name for n, s in self.dst.items()}, child_end), daemon=True
        )
        self.child.start()
        raw_port, self.addresses = self.pipe.recv()
        self.raw = socket.create_connection(("127.0.0.1", raw_port))
        self.raw_chunk = memoryview(rng.integers(0, 256, RAW_WRITE_NBYTES, np.uint8))
        self.loop = asyncio.new_event_loop()
        self.tcp, self.zmq = TcpTransport(), ZmqTcpTransport()
        self.links = {}

    def raw_once(self, nbytes: int) -> None:
        self.raw.sendall(nbytes.to_bytes(8, "little"))
        left = nbytes
        while left:
            n = min(left, RAW_WRITE_NBYTES)
            self.raw.sendall(self.raw_chunk[:n])
            left -= n
        if self.raw.recv(1) != b"k":
            raise SystemExit("raw socket sink went away")

    def write_once(self, name: str, variant: str = "tcp") -> None:
        case = self.cases[name]
        key = (name, variant)
        if key not in self.links:
            transport = self.tcp if variant == "tcp" else self.zmq
            address = self.addresses[name if variant == "tcp" else f"zmq-{name}"]
            endpoint = PeerEndpoint.from_maps("d0", {"dst": case.dst_nbytes}, data_address=address)
            self.links[key] = (transport, self.loop.run_until_complete(transport.connect(endpoint)))
        transport, link = self.links[key]
        room = list(self.cases).index(name)
        self.loop.run_until_complete(transport.write(link, case.plan, {"src": self.src[name]}, room=room))

    def alternate(self, name: str, repeats: int, variant: str = "tcp") -> tuple[float, float, float]:
        """Median seconds of the raw floor and of the case, timed in turns, and the median
        of the per-turn ratios (floor / case): each ratio compares two back-to-back runs,
        so load that comes and goes on a shared machine hits both sides of it."""
        nbytes = self.cases[name].plan.total_nbytes
        floors, runs = [], []
        self.raw_once(nbytes), self.write_once(name, variant)  # warm up
        for _ in range(repeats):
            floors.append(_timed(lambda: self.raw_once(nbytes)))
            runs.append(_timed(lambda: self.write_once(name, variant)))
        ratio = statistics.median(f / r for f, r in zip(floors, runs))
        return statistics.median(floors), statistics.median(runs), ratio

    def spot_check(self, name: str) -> None:
        case = self.cases[name]
        src, dst = self.src[name], self.dst[name].array
        for batch in case.plan.batches:
            s, d, n = batch.byte_runs()
            for i in np.random.default_rng(2).choice(len(n), min(64, len(n)), replace=False):
                if not np.array_equal(dst[d[i] : d[i] + n[i]], src[s[i] : s[i] + n[i]]):
                    raise SystemExit(f"tcp {name}: bytes did not land (run {i})")

    def close(self) -> int:
        self.loop.run_until_complete(self.tcp.close())
        self.loop.run_until_complete(self.zmq.close())
        self.loop.close()
        self.raw.close()
        self.pipe.send("stop")
        refused = self.pipe.recv()
        self.child.join(10)
        for segment in self.dst.values():
            segment.close()
            segment.unlink()
        return refused


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
