"""End-to-end throughput and latency between real sidecar processes.

    python benchmarks/sidecar_bench.py [--tokens 8192] [--repeats 5] [--device cuda]

In one run, on the same bytes: a plain contiguous torch copy (the memory
limit) and a raw loopback TCP stream between two processes (the network
limit; measured right before and after the tcp case), then pd-transfer
moving a Llama-3.1-8B request of ``--tokens`` tokens
(page size 16, random pages) between sidecar processes: shm direct (TP 1 ->
1), shm sliced (TP 2 -> 4), tcp direct (TP 1 -> 1); and the p50 latency of a
1-page room over shm (50 ms after decode's expect, decode's wait called after the
send returned, or already in flight; and paced as an engine paces it, the prefill
worker polling until decode's request has arrived and then sending at once, decode's
wait in flight, the processes warm), each beside the floor of such a room on this
host (``room_floor.py``: the same processes, hops, copy and doorbell with no
protocol, planning or checks), and what 50 ms of idle time, or of other work, alone
costs one planning call in one process (the host's cold-cache penalty, which every
hop of an idle room pays). Each transfer is timed from the prefill worker's
send() to the decode worker seeing Success (bootstrap excluded: one warm-up room
first). Medians of ``--repeats``. Prints a table with ratios against the floors;
no assertion.

``--device cuda`` (on a GPU host): the workers' pools are CUDA tensors shared
through CUDA IPC; the shm cases become device-to-device copies between the
sidecars, the floor is a contiguous copy on the GPU, and the tcp case is
left out (CUDA pools move between sidecars of one host only).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import room_floor  # noqa: E402
from pd_transfer.client import Client, Refused, RoomStatus, allocate_pools  # noqa: E402
from pd_transfer.client.cuda_pools import allocate_cuda_pools  # noqa: E402
from pd_transfer.config.extras import ENGINES  # noqa: E402
from pd_transfer.errors import Reason  # noqa: E402
from pd_transfer.layout.geometry import Role  # noqa: E402
from pd_transfer.layout.presets import load_preset  # noqa: E402
from pd_transfer.layout.rank_builder import build_instance  # noqa: E402
from pd_transfer.layout.views import Layout, Pool  # noqa: E402
from pd_transfer.processes.ports import spare_port  # noqa: E402
from pd_transfer.security.secret import use_ephemeral_secret  # noqa: E402

PAGE = 16
KV_NBYTES_PER_TOKEN = 128 << 10  # Llama-3.1-8B: 32 layers x K, V x 8 heads x 128 x bf16
IDLE_S = 0.05  # between a room's expect and its send: the sidecars are idle when it starts


def memcpy_gbps(nbytes: int, repeats: int, device: str = "cpu") -> float:
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


_TCP_SINK = """
import socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", int(sys.argv[1]))); srv.listen(1)
conn, _ = srv.accept(); buf = bytearray(1 << 20); view = memoryview(buf)
while True:
    n = conn.recv_into(view)
    if n == 0: break
"""


def raw_tcp_gbps(nbytes: int, repeats: int) -> float:
    rates = []
    chunk = b"\x00" * (1 << 20)
    for _ in range(repeats):
        port = spare_port()
        sink = subprocess.Popen([sys.executable, "-c", _TCP_SINK, str(port)])
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.02)
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            conn.sendall(chunk)
        conn.close()
        sink.wait()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


class Deployment:
    """Sidecars plus in-process workers (pools in shm, or CUDA tensors; real clients)."""

    def __init__(
        self,
        workdir: Path,
        tp_src: int,
        tp_dst: int,
        num_pages: int,
        transport: str,
        device: str = "cpu",
        model: str = "llama-3.1-8b",
    ) -> None:
        spec = load_preset(model)
        shape = {
            "page_size": PAGE,
            "num_pages": num_pages,
            "kv_layout": Layout.NHD,
            "num_aux_rows": 4,
            "num_slots": 4,
        }
        self.prefill = build_instance(spec, Role.PREFILL, tp_src, **shape)
        self.decode = build_instance(spec, Role.DECODE, tp_dst, **shape)
        # a hybrid model (Mamba / GDN state) sends one state slot with the last chunk
        self.state = [1] if any(v.pool is Pool.MAMBA for v in self.decode[0].views) else []
        self.bootstrap = f"tcp://127.0.0.1:{spare_port()}"
        self.procs, self.clients, self.pools = [], {}, []
        use_ephemeral_secret(workdir)  # sidecars and clients authenticate, as deployed
        for geometry in self.prefill + self.decode:
            name = f"{geometry.role.value}{geometry.tp_rank}"
            cmd = [
                sys.executable,
                "-m",
                "pd_transfer.cli",
                "serve",
                "--role",
                geometry.role.value,
                "--agent-id",
                name,
                "--worker-endpoint",
                f"unix://{workdir}/{name}.sock",
                "--transport",
                transport,
                "--ready-file",
                str(workdir / f"{name}.json"),
                "--http-port",
                "0",
                "--log-level",
                "warning",
            ]
            if geometry.role is Role.PREFILL:
                cmd += ["--bootstrap", self.bootstrap]
            if transport in ENGINES:  # their own listeners authenticate nobody (docs/security.md)
                cmd += ["--allow-unauthenticated-engine"]
            self.procs.append(subprocess.Popen(cmd))
        for geometry in self.prefill + self.decode:
            name = f"{geometry.role.value}{geometry.tp_rank}"
            while not (workdir / f"{name}.json").exists():
                time.sleep(0.02)
            if device == "cuda":
                pools = allocate_cuda_pools(geometry)
            else:
                pools = allocate_pools(geometry, f"bench-{name}-{transport}")
            self.pools.append(pools)
            for tensor in pools.tensors.values():
                tensor.fill_(7)
            client = Client(f"unix://{workdir}/{name}.sock", name, timeout_s=60)
            client.register(geometry, pools.handles)
            self.clients[geometry.rank_id] = client

    def room(
        self,
        room: int,
        src_pages,
        dst_pages,
        *,
        waiting: bool = False,
        idle_s: float = IDLE_S,
        paced: bool = False,
    ) -> float:
        """Seconds from the prefill worker's send() to every decode worker seeing Success.

        ``waiting``: each decode worker's ``wait`` is already in flight when the send
        goes (as an engine waits on its rooms), instead of being called after send()
        returned; the clock still stops when the last decode worker has the answer.
        ``paced``: instead of sleeping ``idle_s``, each prefill worker polls the room
        until its sidecar reports it waiting for input (decode's request has arrived),
        then sends, as an engine's prefill scheduler does before it runs a request.
        """
        for g in self.decode:
            self.clients[g.rank_id].expect(room, self.bootstrap, dst_pages, aux_row=0, state_slots=self.state)
        seen: dict[str, tuple] = {}

        def wait(rank_id: str) -> None:
            seen[rank_id] = (self.clients[rank_id].wait(room, 120), time.perf_counter())

        # daemons: a room that fails before its send leaves them waiting, not the process
        waiters = (
            [threading.Thread(target=wait, args=(g.rank_id,), daemon=True) for g in self.decode]
            if waiting
            else []
        )
        for thread in waiters:
            thread.start()
        if paced:
            self.until_requested(room)
        else:
            time.sleep(idle_s)  # let the requests reach prefill: time the transfer, not the request
        start = time.perf_counter()
        for g in self.prefill:
            self.clients[g.rank_id].send(room, src_pages, aux_row=0, state_slots=self.state)
        for thread in waiters:
            thread.join()
        if not waiting:
            for g in self.decode:
                wait(g.rank_id)
        for state, _ in seen.values():
            if state.status.value != "success":
                raise RuntimeError(f"room {room} failed: {state.reason}")
        return max(t for _, t in seen.values()) - start

    def until_requested(self, room: int, timeout_s: float = 10.0) -> None:
        """Poll every prefill rank until ``room`` is waiting for input (200 us apart)."""
        deadline = time.monotonic() + timeout_s
        for g in self.prefill:
            while True:
                try:
                    state = self.clients[g.rank_id].poll(room)
                except Refused as err:  # decode's request has not reached this rank yet
                    if err.code is not Reason.UNKNOWN_ROOM:
                        raise
                else:
                    if state.status is RoomStatus.WAITING_FOR_INPUT:
                        break
                    if state.status.is_terminal:
                        raise RuntimeError(f"room {room} ended before its send: {state.reason}")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"room {room}: decode's request did not reach {g.rank_id} in {timeout_s:.0f} s"
                    )
                time.sleep(0.0002)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()
        for pools in self.pools:
            pools.close()


def transfer_case(
    workdir: Path,
    tp_src: int,
    tp_dst: int,
    transport: str,
    tokens: int,
    repeats: int,
    device: str = "cpu",
    model: str = "llama-3.1-8b",
) -> tuple[float, int]:
    """Median seconds of a ``tokens`` request and the bytes it lands (KV, state, aux)."""
    pages = tokens // PAGE
    deployment = Deployment(workdir, tp_src, tp_dst, pages + 64, transport, device, model)
    try:
        rng = np.random.default_rng(0)
        items = {Pool.KV: pages, Pool.MAMBA: len(deployment.state), Pool.AUX: 1}
        total = sum(v.item_nbytes * items.get(v.pool, 0) for g in deployment.decode for v in g.views)
        deployment.room(1, list(range(4)), list(range(4)))  # warm-up: bootstrap, verdicts
        times = []
        for i in range(repeats):
            src = rng.choice(pages + 64, pages, replace=False).tolist()
            dst = rng.choice(pages + 64, pages, replace=False).tolist()
            times.append(deployment.room(100 + i, src, dst))
        return statistics.median(times), total
    finally:
        deployment.close()


LATENCY_MODES = ("wait after send", "wait in flight", "paced")


def one_page_latency_ms(workdir: Path, rooms: int, device: str = "cpu") -> tuple[float, ...]:
    """p50 ms of a 1-page room, per :data:`LATENCY_MODES`: 50 ms after its expect, decode's
    wait called after send returned; the same with the wait already in flight; paced as an
    engine paces it, with no pause: the prefill worker polls until decode's request has
    arrived, then sends, decode's wait in flight (the processes stay warm)."""
    deployment = Deployment(workdir, 1, 1, 64, "shm", device)
    try:
        deployment.room(1, [0], [0])
        after = [deployment.room(1000 + i, [i % 64], [(i * 7) % 64]) for i in range(rooms)]
        during = [deployment.room(3000 + i, [i % 64], [(i * 5) % 64], waiting=True) for i in range(rooms)]
        paced = [
            deployment.room(5000 + i, [i % 64], [(i * 3) % 64], waiting=True, paced=True)
            for i in range(rooms)
        ]
        return tuple(statistics.median(t) * 1e3 for t in (after, during, paced))
    finally:
        deployment.close()


def idle_penalty_us(samples: int = 40, idle_s: float = IDLE_S) -> tuple[float, float, float]:
    """p50 microseconds of planning one 1-page Llama room in this process: back to back,
    after ``idle_s`` of sleep, and after ``idle_s`` of other work (a busy loop, the CPU never
    idle): what time away alone costs the same code on this host (caches, TLBs and branch
    predictors refilled), with no message and no other process involved. The third figure
    tells a sleeping CPU (wake-up, clock) from a working set pushed out of the caches."""
    from pd_transfer.layout.planner import PairPlanner
    from pd_transfer.layout.reconcile import reconcile

    spec = load_preset("llama-3.1-8b")
    shape = {"page_size": PAGE, "num_pages": 64, "kv_layout": Layout.NHD, "num_aux_rows": 4}
    prefill = build_instance(spec, Role.PREFILL, 1, **shape)
    decode = build_instance(spec, Role.DECODE, 1, **shape)
    planner = PairPlanner(reconcile(prefill, decode), prefill[0], decode[0])

    def once(i: int) -> float:
        request = {
            Pool.KV: (np.array([i % 64]), np.array([(i * 7) % 64])),
            Pool.AUX: (np.array([0]), np.array([0])),
        }
        start = time.perf_counter()
        planner.plan(request)
        return time.perf_counter() - start

    for i in range(samples):
        once(i)
    warm = statistics.median(once(i) for i in range(samples))
    cold, busy = [], []
    for i in range(samples):
        time.sleep(idle_s)
        cold.append(once(i))
        end = time.perf_counter() + idle_s
        while time.perf_counter() < end:
            pass
        busy.append(once(i))
    return warm * 1e6, statistics.median(cold) * 1e6, statistics.median(busy) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only",
        choices=("all", "shm", "tcp"),
        default="all",
        help="run the shm cases or the tcp case alone (and its floor)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the workers' pools live (cuda: CUDA IPC, no tcp case)",
    )
    args = parser.parse_args()
    if args.device == "cuda":
        args.only = "shm"
    workdir = Path(tempfile.mkdtemp(prefix="pdt-bench-"))
    rows = []
    results = {}
    cases = [
        ("shm direct  TP 1->1", 1, 1, "shm"),
        ("shm sliced  TP 2->4", 2, 4, "shm"),
        ("tcp direct  TP 1->1", 1, 1, "tcp"),
    ]
    tcp_rates = []
    for label, tp_src, tp_dst, transport in cases:
        if args.only not in ("all", transport):
            continue
        if transport == "tcp":  # the network floor right before and after the case
            tcp_rates.append(raw_tcp_gbps(args.tokens * KV_NBYTES_PER_TOKEN, 3))
        seconds, nbytes = transfer_case(
            workdir, tp_src, tp_dst, transport, args.tokens, args.repeats, args.device
        )
        results[label] = (seconds, nbytes)
        if transport == "tcp":
            tcp_rates.append(raw_tcp_gbps(nbytes, 3))
    nbytes = next(iter(results.values()))[1]
    copy = memcpy_gbps(nbytes, args.repeats, args.device)
    tcp = statistics.median(tcp_rates) if tcp_rates else raw_tcp_gbps(nbytes, 3)
    latency = one_page_latency_ms(workdir, 200, args.device) if args.only != "tcp" else None
    bare, no_floor = None, "pools on cuda"
    if latency is not None and args.device == "cpu":
        try:
            bare, no_floor = room_floor.measure(workdir, 200), ""
        except RuntimeError as err:
            no_floor = str(err)
    penalty = idle_penalty_us() if latency is not None else None
    print(
        f"Llama-3.1-8B, {args.tokens} tokens, page {PAGE}, random pages: "
        f"{nbytes / 2**30:.2f} GiB of KV per request; medians of {args.repeats}; "
        f"pools on {args.device}"
    )
    print(f"{'case':<24}{'seconds':>9}{'GB/s':>8}{'ratio':>8}  floor / target")
    print(f"{'contiguous copy':<24}{nbytes / copy / 1e9:>9.3f}{copy:>8.2f}{1:>8.2f}  memory floor")
    print(f"{'raw loopback tcp':<24}{nbytes / tcp / 1e9:>9.3f}{tcp:>8.2f}{1:>8.2f}  network floor")
    targets = {
        "shm direct  TP 1->1": (copy, 0.6, "copy"),
        "shm sliced  TP 2->4": (copy, 0.4, "copy"),
        "tcp direct  TP 1->1": (tcp, 0.6, "raw tcp"),
    }
    for label, (seconds, moved) in results.items():
        floor, target, name = targets[label]
        rate = moved / seconds / 1e9
        verdict = "met" if rate / floor >= target else "missed"
        print(
            f"{'pd-transfer ' + label:<24}{seconds:>9.3f}{rate:>8.2f}{rate / floor:>8.2f}  "
            f"x {name}; target >= {target} ({verdict})"
        )
    if latency is not None:
        for i, (label, value) in enumerate(zip(LATENCY_MODES, latency)):
            beside = f"; {value / bare[i]:.1f} x the bare room, {bare[i]:.3f} ms" if bare else ""
            print(
                f"{'1-page room p50':<16}{label:<16}{value:>8.3f} ms   target < 1 ms "
                f"({'met' if value < 1 else 'missed'}) (send -> decode sees success, shm{beside})"
            )
        if bare:
            print(
                f"{'bare room floor':<24}{bare[0]:>8.3f} ms   the same hops, copy and doorbell "
                f"between processes, no protocol (room_floor.py); "
                f"{bare[1]:.3f} in flight, {bare[2]:.3f} back to back"
            )
        else:
            print(f"{'bare room floor':<24}{'-':>8}      not measured: {no_floor}")
        warm, cold, busy = penalty
        print(
            f"{'idle penalty':<24}{cold / warm:>8.1f} x    one 1-page plan in one process: "
            f"{warm:.0f} us back to back, {cold:.0f} us after {IDLE_S * 1e3:.0f} ms idle, "
            f"{busy:.0f} us after {IDLE_S * 1e3:.0f} ms of a busy loop"
        )
    rows.append(results)
    (workdir / "results.json").write_text(json.dumps({k: v[0] for k, v in results.items()}))


if __name__ == "__main__":
    main()
