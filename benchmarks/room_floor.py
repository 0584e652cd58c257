"""The floor of a same-host 1-page room: its hops and its copy, with nothing else.

    python benchmarks/room_floor.py [--rooms 200]

A room over shm needs, at the least: the prefill worker writes a request to
its sidecar over a Unix socket; the sidecar, woken, copies the room's pieces
from the worker's shared memory into the decode pool's; it rings the decode
worker's doorbell (a futex); the decode worker's waiting thread wakes. This
measures exactly that, between real processes: a relay process (uvloop, as
the sidecar) reading a 32-byte request, copying the pieces with pd-transfer's
native loop between two shared-memory segments of the sidecar bench's size,
ringing a :class:`~pd_transfer.memory.doorbell.Doorbells` slot and replying (numpy
copies where the native loop is not built, as the sidecars then copy). No
protocol, no validation, no planning, no bounds check, no metrics: what is
left is what the host charges for the hops and the bytes.

Timed as ``sidecar_bench.py`` times its 1-page rooms, in the same three modes
(:data:`MODES`): from the request's write to the waiting thread seeing the
ring. Afterwards every destination page is checked against the source page
last copied into it. ``sidecar_bench.py`` prints each mode beside the
sidecars' room.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_transfer.memory import doorbell  # noqa: E402
from pd_transfer.memory.doorbell import Doorbells, Outcome  # noqa: E402
from pd_transfer.memory.segments import create_segment, open_segment, segment_name  # noqa: E402
from pd_transfer.transport.copy import native_loop  # noqa: E402

MODES = ("wait after send", "wait in flight", "back to back")
IDLE_S = 0.05
REQUEST = struct.Struct("<qqqq")  # source page, destination page, doorbell slot, token
REPLY = b"ok"


def _relay(
    path: str, src_name: str, dst_name: str, bells_name: str, pieces: int, pages: int, page_nbytes: int
) -> None:
    """The relay process: serve one connection until it closes."""
    src, dst = open_segment(src_name), open_segment(dst_name)
    bells = Doorbells.open(bells_name)
    src_base = src.array.__array_interface__["data"][0]
    dst_base = dst.array.__array_interface__["data"][0]
    region = pages * page_nbytes
    stop = asyncio.Event()  # set when the bench closes its connection

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                src_page, dst_page, slot, token = REQUEST.unpack(await reader.readexactly(REQUEST.size))
                if native_loop.AVAILABLE:
                    runs = []
                    for piece in range(pieces):  # one page of every region, as a 1-page room
                        runs += (
                            dst_base + piece * region + dst_page * page_nbytes,
                            src_base + piece * region + src_page * page_nbytes,
                            page_nbytes,
                        )
                    native_loop.copy_list(runs)
                else:  # as the sidecars copy without the native loop: numpy slices
                    for piece in range(pieces):
                        d, s = (
                            piece * region + dst_page * page_nbytes,
                            piece * region + src_page * page_nbytes,
                        )
                        dst.array[d : d + page_nbytes] = src.array[s : s + page_nbytes]
                bells.ring(slot, token, 0)
                writer.write(REPLY)
        except asyncio.IncompleteReadError:
            stop.set()

    async def main() -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        server = await asyncio.start_unix_server(serve, sock=listener)
        Path(path + ".ready").touch()
        await stop.wait()
        server.close()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def measure(
    workdir: Path,
    rooms: int,
    pieces: int = 64,
    pages: int = 64,
    page_nbytes: int = 32 << 10,
    idle_s: float = IDLE_S,
) -> tuple[float, ...]:
    """p50 ms of the bare room in each of :data:`MODES`. Defaults: a Llama-3.1-8B page
    (64 regions, K and V of 32 layers, 32 KiB each) in pools of 64 pages, as the
    sidecar bench's 1-page rooms."""
    if not doorbell.AVAILABLE:
        raise RuntimeError(
            "no doorbells on this platform (futex, Linux x86-64): same-host "
            "rooms end through messages here, which this floor does not model"
        )
    tag = f"{os.getpid()}-{time.monotonic_ns() % 10**9}"
    nbytes = pieces * pages * page_nbytes
    src = create_segment(segment_name("floor", f"src-{tag}"), nbytes)
    dst = create_segment(segment_name("floor", f"dst-{tag}"), nbytes)
    bells = Doorbells.create(f"floor{tag}")
    # every page of every region its own bytes (touched, as pools a worker filled), so
    # that a piece copied from or to the wrong place shows; the destination zeroed
    page_of = (np.arange(pieces * pages, dtype=np.uint32) * 37 % 251 + 1).astype(np.uint8)
    ramp = (np.arange(page_nbytes) % 253).astype(np.uint8)
    src_pages = src.array.reshape(pieces, pages, page_nbytes)
    np.add(page_of.reshape(pieces, pages, 1), ramp, out=src_pages)
    dst.array[:] = 0
    path = str(workdir / f"floor-{tag}.sock")
    relay = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--relay",
            path,
            src.name,
            dst.name,
            bells.name,
            str(pieces),
            str(pages),
            str(page_nbytes),
        ]
    )
    sock = socket.socket(socket.AF_UNIX)
    try:
        while not os.path.exists(path + ".ready"):
            if relay.poll() is not None:
                raise RuntimeError(f"the relay process exited with {relay.returncode}")
            time.sleep(0.01)
        sock.connect(path)
        results, landed = [], {}
        for mode in MODES:
            pause = 0.0 if mode == "back to back" else idle_s
            times = [
                _room(sock, bells, i, pages, landed, waiting=mode != "wait after send", pause=pause)
                for i in range(rooms + 1)
            ][1:]  # the first one maps pages: not timed
            results.append(statistics.median(times) * 1e3)
        _check(src_pages, dst.array.reshape(pieces, pages, page_nbytes), landed)
        return tuple(results)
    finally:
        sock.close()  # the relay's cue to exit
        try:
            relay.wait(timeout=10)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait()
        for segment in (src, dst, bells.segment):
            segment.close()
            segment.unlink()
        for leftover in (path, path + ".ready"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _check(src: np.ndarray, dst: np.ndarray, landed: dict[int, int]) -> None:
    """Every destination page holds the source page last copied into it, every other
    one is still zero: the floor moved the room's bytes, and only those."""
    for page in range(dst.shape[1]):
        expected = src[:, landed[page]] if page in landed else 0
        if not np.array_equal(dst[:, page], np.broadcast_to(expected, dst[:, page].shape)):
            raise RuntimeError(
                f"the bare room's destination page {page} does not hold what was copied into it"
            )


def _room(
    sock: socket.socket,
    bells: Doorbells,
    i: int,
    pages: int,
    landed: dict[int, int],
    *,
    waiting: bool,
    pause: float,
) -> float:
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    seen: list[tuple[Outcome, float]] = []

    def wait() -> None:
        seen.append((bells.wait(slot, token, 10.0), time.perf_counter()))

    waiter = threading.Thread(target=wait) if waiting else None
    if waiter is not None:
        waiter.start()
    time.sleep(pause)
    start = time.perf_counter()
    sock.sendall(REQUEST.pack(i % pages, (i * 7) % pages, slot, token))
    landed[(i * 7) % pages] = i % pages
    if sock.recv(len(REPLY)) != REPLY:
        raise RuntimeError("the relay process did not answer")
    if waiter is None:
        wait()
    else:
        waiter.join()
    outcome, end = seen[0]
    if outcome is not Outcome.RUNG:
        raise RuntimeError(f"room {i}: the doorbell {outcome.value}, not rung")
    return end - start


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--relay":
        path, src, dst, bells, pieces, pages, page_nbytes = sys.argv[2:9]
        _relay(path, src, dst, bells, int(pieces), int(pages), int(page_nbytes))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", type=int, default=200)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pdt-floor-") as workdir:
        for mode, value in zip(MODES, measure(Path(workdir), args.rooms)):
            print(f"bare room p50 {mode:<16}{value:>8.3f} ms")


if __name__ == "__main__":
    main()
