"""Engine transports beside the machine's limits and the engines alone, on the same bytes.

Three descriptor sets, each moved from a 256 MiB source buffer into a 512 MiB
destination pool (shared memory, mapped by a receiver process):

  (a) one 256 MiB block
  (b) 16,384 runs of 16 KiB, random source pages -> random destination pages
  (c) 65,536 runs of 2 KiB, random source slots -> random destination slots

and for each, in one run:

  torch copy_       contiguous copy of the same number of bytes (memory limit)
  raw tcp           Python sockets on 127.0.0.1, 1 MiB ``sendall`` into a
                    receiver process (the loopback limit)
  raw tcp, iovecs   the case's own pieces through two bare sockets (as many
                    as pd-transfer's tcp streams), half each: ``sendmsg`` from
                    the source runs, ``recvmsg`` into the destination runs
                    (1,024 iovecs a call), no framing or checks: what the
                    kernel alone charges for scattered pieces (not a target)
  mooncake TE       Mooncake's engine alone (tcp, P2P handshake), the same
                    descriptors in three ways: ``batch_transfer_sync_write`` in
                    batches of 1,024 with its default per-peer queues; one
                    sync batch of all of them, per-peer queues enlarged to
                    65,535 (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``,
                    ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``); batches of
                    1,024 all posted with ``batch_transfer_async_write``, then
                    one ``get_batch_transfer_status`` (queues 65,535)
  nixl UCX tcp/shm  NIXL alone (UCX_TLS=tcp, then UCX_TLS=shm), as vLLM's
                    NixlConnector drives it: descriptor lists prepared once
                    (``prep_xfer_dlist``), one ``make_prepped_xfer("WRITE")`` per
                    request; the initiating agent with NIXL's progress thread
                    and without (the receiving agent keeps its own); without,
                    and completion signalled by a NIXL notification that the
                    receiving agent's ``get_new_notifs`` returns; the UCX
                    backend's ``num_threads`` 4; and vLLM's own configuration
                    (4 UCX threads, progress thread, notification). Settings:
                    ``engines_alone.py``
  pd-transfer tcp/shm  the same descriptors as a plan through the built-in
                    transports: TcpTransport into a TcpReceiver in the
                    receiver process, ShmTransport mapping the destination
  pd-transfer ...   the same descriptors as a plan through MooncakeTransport /
                    NixlTransport (bounds checks, joining, batching included)
                    with ``strategy = auto``: each write goes as direct runs or
                    staged (gathered into 4 MiB slots, one descriptor each,
                    scattered by the receiver) by the crossover the link
                    measured at connect; the row says which was chosen.
                    The nixl transport runs once per UCX thread count its
                    engine-alone rows try (``nixl_ucx_threads`` 1 and 4); a
                    row of its own takes the faster per case and names it

Each engine runs between fresh processes: a receiver that registers the
destination (one per engine and UCX setting), and one sender process for each
setting of the engine alone and another for pd-transfer, so none runs beside
another's threads. Each pd-transfer engine row is compared with the fastest
setting of its engine alone, per case, and names it (nixl: pd-transfer at
its best too). A "turns" row runs
pd-transfer's write and the engine alone on pd-transfer's own engine (the same
agent or TransferEngine) in one process, one after the other, the order
swapped every turn, and divides per turn: on a shared host the two then see the
same moment. ``--rounds N`` runs every group N times, its rows in turn, and
reports the median of the rounds. The parent
checks the destination bytes after every case. Figures are medians of
``--repeats`` runs, the copy floor's too; the raw tcp floors are medians of 7
runs before the engines and 7 after (on 2 vCPUs their speed swings by 2x with
where the scheduler puts the two processes and with what just ran, so a floor
taken once, or its single best run, says more about the moment than about the
path). The tcp targets compare medians with medians, and also print the ratio
against the floor's best run; GB/s is 10^9 bytes per second. Rows whose engine is not
installed say so. Run: ``python benchmarks/engines_bench.py [--repeats 3] [--rounds 2]
[--only mooncake,nixl-tcp] [--cases ab]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engines_alone import (  # noqa: E402
    answer_notifications,
    mooncake_alone,
    mooncake_request,
    nixl_alone,
    nixl_request,
    timed,
)
from pd_transfer.memory.segments import create_segment, open_segment  # noqa: E402
from pd_transfer.transport.tcp.transport import DEFAULT_STREAMS  # noqa: E402

MIB = 1 << 20
SRC_NBYTES, DST_NBYTES = 256 * MIB, 512 * MIB
CASES = {
    "a": ("(a) 1 x 256 MiB", 256 * MIB, 1),
    "b": ("(b) 16,384 x 16 KiB", 16 * 1024, 16384),
    "c": ("(c) 65,536 x 2 KiB", 2048, 65536),
}
W = 66  # the path column's width
RAW_IOV_STREAMS = DEFAULT_STREAMS  # as many sockets as pd-transfer's tcp links have
MOONCAKE_QUEUES = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


MOONCAKE_ASYNC = 1024  # descriptors per posted batch (the engine's default per-peer queue: 2,048)
UCX_THREADS = (1, 4)  # pd-transfer nixl's settings tried: the UCX threads its alone rows try


def _threads(n: int) -> str:
    return f"{n} UCX thread" + ("s" if n > 1 else "")


def _nixl_group(tls: str) -> tuple[str, dict, list]:
    def alone(name: str, **settings) -> tuple[str, str, dict]:
        return (f"nixl UCX {tls}, {name}", "nixl-raw", settings)

    def pd(n: int) -> tuple[str, str, dict]:
        return (f"pd-transfer nixl (UCX {tls}), {_threads(n)}", "nixl-pd", {"ucx_threads": n})

    return (
        f"nixl-{tls}",
        {"UCX_TLS": tls},
        [
            alone("progress thread", progress_thread=True),
            alone("no progress thread", progress_thread=False),
            alone("no progress thread, notif", progress_thread=False, notif=True),
            alone("4 UCX threads, no progress thread", progress_thread=False, ucx_threads=4),
            alone(
                "vLLM's: 4 UCX threads, progress thread, notif",
                progress_thread=True,
                ucx_threads=4,
                notif=True,
            ),
            *(pd(n) for n in UCX_THREADS),
            (f"pd-transfer nixl (UCX {tls}), turns with nixl alone", "nixl-pair", {}),
        ],
    )


# (name, the receiver's and its senders' env, [(row label, sender mode, that sender's
# settings)]): one receiver per group; an engine's group lists its settings alone, then
# pd-transfer (the engine-alone settings: benchmarks/engines_alone.py)
GROUPS = [
    ("builtin", {}, [("pd-transfer tcp", "builtin-tcp", {}), ("pd-transfer shm", "builtin-shm", {})]),
    (
        "mooncake",
        {},
        [
            ("mooncake TE tcp, sync batches of 1,024", "mooncake-raw", {"batch": 1024}),
            (
                "mooncake TE tcp, one sync batch, queues 65,535",
                "mooncake-raw",
                {"batch": 1 << 16, "env": MOONCAKE_QUEUES},
            ),
            (
                "mooncake TE tcp, async batches of 1,024, queues 65,535",
                "mooncake-raw",
                {"batch": MOONCAKE_ASYNC, "submit": "async", "env": MOONCAKE_QUEUES},
            ),
            ("pd-transfer mooncake (tcp)", "mooncake-pd", {}),
            ("pd-transfer mooncake (tcp), turns with mooncake alone", "mooncake-pair", {}),
        ],
    ),
    _nixl_group("tcp"),
    _nixl_group("shm"),
]
MODES = [row for _, _, rows in GROUPS for row in rows]
ALONE = {
    pd[0]: [label for label, mode, _ in rows if mode.endswith("-raw")]
    for _, _, rows in GROUPS
    for pd in rows
    if pd[1].endswith("-pd")
}  # pd-transfer row -> its peers
# pd-transfer at its best -> its rows of one setting each (nixl: per UCX thread count);
# the best row is the fastest of them per case, and compares with the engine's best
BEST_OF = {
    label.split(", ")[0]: [pd for pd in ALONE if pd.startswith(label.split(", ")[0] + ", ")]
    for label in ALONE
    if ", " in label
}
ALONE.update({best: ALONE[variants[0]] for best, variants in BEST_OF.items()})
VARIANTS = {label for variants in BEST_OF.values() for label in variants}
PRINTED = [  # the rows in print order: each best row after its settings' rows
    shown
    for label, _, _ in MODES
    for shown in [label, *(best for best, variants in BEST_OF.items() if label == variants[-1])]
]


def descriptors(case: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    _, run, count = CASES[case]
    if count == 1:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, run, np.int64)
    src = rng.permutation(SRC_NBYTES // run)[:count].astype(np.int64) * run
    dst = rng.permutation(DST_NBYTES // run)[:count].astype(np.int64) * run
    return src, dst, np.full(count, run, np.int64)


# -- children ---------------------------------------------------------------------------
def receiver_main(args: dict) -> None:
    from pd_transfer.transport.engines.registry import make_receiver
    from pd_transfer.transport.tcp.receiver import TcpReceiver

    segment = open_segment(args["dst"])

    async def serve() -> None:
        if args["kind"] == "builtin":  # tcp into this process; shm needs nobody here
            receiver = TcpReceiver("127.0.0.1", {"dst": segment.tensor})
            await receiver.start()
            address = receiver.address
        else:
            receiver = make_receiver(args["kind"], {"dst": segment.tensor})
            address = await receiver.start()
        stop = threading.Event()
        if args["kind"] == "nixl":  # the engine-alone rows that end on a notification
            threading.Thread(
                target=answer_notifications, args=(receiver.engine.agent, stop), daemon=True
            ).start()
        print(json.dumps({"address": address}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        stop.set()
        await receiver.stop()

    asyncio.run(serve())


def sender_main(args: dict) -> None:
    src = open_segment(args["src"]).tensor
    sets = np.load(args["sets"])
    address, repeats = args["address"], args["repeats"]
    states: dict[str, dict] = {"settings": args.get("settings", {})}
    for line in sys.stdin:
        case, mode = line.split()
        run_case = {"mooncake-raw": mooncake_alone, "nixl-raw": nixl_alone}.get(mode, _pd_transport)
        address = args["dst"] if mode == "builtin-shm" else args["address"]
        s, d, n = sets[f"{case}_src"], sets[f"{case}_dst"], sets[f"{case}_n"]
        state = states.setdefault(mode, {"settings": states["settings"]})
        if mode.endswith("-pair"):
            answer = _paired(state, mode, address, src, s, d, n, repeats)
        elif run_case is _pd_transport:
            answer = {"seconds": statistics.median(run_case(state, mode, address, src, s, d, n, repeats))}
        else:
            answer = {"seconds": statistics.median(run_case(state, address, src, s, d, n, repeats))}
        print(json.dumps({**answer, **_chosen(state)}), flush=True)
    for state in states.values():
        if isinstance(state, dict) and "close" in state:
            state["close"]()


def _chosen(state: dict) -> dict:
    """What the pd-transfer link chose for its last write, and its measured crossover."""
    link = state.get("link")
    if link is None or not hasattr(link, "last_strategies"):  # built-in tcp/shm links
        return {}
    chosen = "+".join(sorted(s.value for s in link.last_strategies)) or "-"
    crossover = link.staging.crossover_nbytes if link.staging is not None else 0.0
    return {"strategy": chosen, "crossover": crossover}


def _pd_transport(state, mode, address, src, s, d, n, repeats) -> list[float]:
    return timed(_pd_write(state, mode, address, src, s, d, n), repeats)


def _pd_write(state, mode, address, src, s, d, n):
    """One write of the case through pd-transfer's transport of ``mode`` (connected once)."""
    from pd_transfer.layout.lowering import RunBatch, TransferPlan
    from pd_transfer.transport.engines.registry import make_transport

    loop = state.setdefault("loop", asyncio.new_event_loop())
    if "transport" not in state:
        state["transport"], peer = _pd_peer(mode, address, make_transport, state["settings"])
        state["link"] = loop.run_until_complete(state["transport"].connect(peer))
        state["close"] = lambda: loop.run_until_complete(state["transport"].close())
    plan = TransferPlan("p", "d", (RunBatch("src", "dst", s, d, n, np.ones(len(n), np.int64), 0, 0),))
    regions = {"src": src}
    return lambda: loop.run_until_complete(state["transport"].write(state["link"], plan, regions))


def _paired(state, mode, address, src, s, d, n, repeats) -> dict:
    """pd-transfer's write and the engine alone on pd-transfer's own engine (the same
    agent or TransferEngine, its settings, its registrations), in turns, the order
    swapped every turn: both see the same moment of a noisy host. Per turn the ratio
    engine alone (its fastest way here) / pd-transfer; the median of those."""
    kind = mode.split("-")[0]
    pd_once = _pd_write(state, f"{kind}-pd", address, src, s, d, n)
    pd_once()  # connects, registers the source, prepares pd-transfer's lists
    link, transport = state["link"], state["transport"]
    src_addr, dst_addr = src.data_ptr() + s, link.dst_bases["dst"][0] + d
    if kind == "nixl":
        once, done = nixl_request(transport.engine(), link.remote, src_addr, dst_addr, n)
        alone = {"prepped, no progress thread": once}
    else:
        engine, session, done = transport._engine.engine, link.address.session, lambda: None
        alone = {
            f"sync batches of {b:,}": mooncake_request(
                engine, session, src_addr, dst_addr, n, batch=b, posted=False
            )
            for b in (1024, 1 << 16)
        }
    for fn in alone.values():
        fn()
    turns: list[dict] = []
    budget = time.monotonic() + 20.0
    try:
        while len(turns) < repeats and time.monotonic() < budget:
            turn = {}
            order = [("pd", pd_once), *alone.items()]
            for name, fn in order[:: -1 if len(turns) % 2 else 1]:
                turn[name] = _once(fn)
            turns.append(turn)
    finally:
        done()
    best = [min(turn[k] for k in alone) for turn in turns]
    return {
        "seconds": statistics.median(turn["pd"] for turn in turns),
        "alone": statistics.median(best),
        "ratio": statistics.median(b / turn["pd"] for b, turn in zip(best, turns)),
        "turns": len(turns),
        "ways": list(alone),
    }


def _once(fn) -> float:
    start = time.monotonic()
    ended = fn()
    now = time.monotonic()
    return (max(ended, start) if isinstance(ended, float) else now) - start


def _pd_peer(mode: str, address: str, make_transport, settings: dict):
    """The transport of ``mode`` (nixl: with ``settings``' UCX threads) and the destination
    it connects to (shm: the segment)."""
    from pd_transfer.transport import PeerEndpoint, ShmTransport, TcpTransport

    if mode == "builtin-shm":
        return ShmTransport(), PeerEndpoint.from_maps("d", {"dst": DST_NBYTES}, {"dst": address})
    kind = mode.split("-")[0]
    threads = {"ucx_threads": settings["ucx_threads"]} if "ucx_threads" in settings else {}
    transport = TcpTransport() if mode == "builtin-tcp" else make_transport(kind, **threads)
    return transport, PeerEndpoint.from_maps("d", {"dst": DST_NBYTES}, data_address=address)


# -- floors ------------------------------------------------------------------------------
FLOOR_REPEATS = 7  # runs per floor, before the engines and again after: on 2 vCPUs a
# run's speed depends on where the scheduler put the two processes (the same 128 MiB
# took 27-32 or 67-74 ms)


def _raw_receiver(port_queue, sizes: list[int], repeats: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(bytearray(4 * MIB))
    for total in sizes:
        for _ in range(repeats + 1):
            left = total
            while left:
                left -= conn.recv_into(buf, min(left, len(buf))) or left
            conn.sendall(b"k")


def raw_tcp_seconds(sizes: list[int]) -> dict[int, list[float]]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_raw_receiver, args=(ports, sizes, FLOOR_REPEATS), daemon=True)
    child.start()
    conn = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
    chunk = memoryview(np.random.default_rng(0).integers(0, 256, MIB, np.uint8))
    out = {}
    for total in sizes:

        def once(total=total) -> None:
            for start in range(0, total, MIB):
                conn.sendall(chunk[: min(MIB, total - start)])
            if conn.recv(1) != b"k":
                raise SystemExit("raw tcp receiver went away")

        out[total] = timed(once, FLOOR_REPEATS, budget_s=1e9)
    conn.close()
    child.join(10)
    return out


def _raw_iov_receiver(port_queue, names: dict, sets_path: str, repeats: int) -> None:
    from pd_transfer.transport.tcp.native_io import recv_iov

    dst, sets = open_segment(names["dst"]), np.load(sets_path)
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conns = [server.accept()[0] for _ in range(RAW_IOV_STREAMS)]
    for case in (c for c in CASES if f"{c}_n" in sets):  # those the parent runs
        halves = _halves(_iov(dst.array, sets[f"{case}_dst"], sets[f"{case}_n"]))
        for _ in range(repeats + 1):
            _both(recv_iov, conns, halves)
            conns[0].sendall(b"k")


def _iov(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    iov = np.empty((len(offset), 2), np.uint64)
    iov[:, 0], iov[:, 1] = offset + region.__array_interface__["data"][0], nbytes
    return iov


def _halves(iov: np.ndarray) -> list[np.ndarray]:
    """The pieces cut into one share per stream (a single piece: cut into equal parts)."""
    if len(iov) == 1:
        ((address, nbytes),) = iov.tolist()
        cuts = np.linspace(0, nbytes, RAW_IOV_STREAMS + 1).astype(np.uint64)
        return [np.array([[address + a, b - a]], np.uint64) for a, b in zip(cuts[:-1], cuts[1:])]
    return np.array_split(iov, RAW_IOV_STREAMS)


def _both(call, conns: list[socket.socket], shares: list[np.ndarray]) -> None:
    """``call(conn, share)`` on every stream at once, one thread each (the GIL is released)."""
    threads = [
        threading.Thread(target=call, args=(conn, share)) for conn, share in zip(conns[1:], shares[1:])
    ]
    for thread in threads:
        thread.start()
    call(conns[0], shares[0])
    for thread in threads:
        thread.join()


def raw_iov_seconds(names: dict, sets_path: str, src, dst) -> dict[str, list[float]]:
    """Per case: the case's pieces through bare loopback sockets (as many as pd-transfer's
    tcp streams), straight from the source runs into the destination runs."""
    from pd_transfer.transport.tcp.native_io import AVAILABLE, send_iov

    if not AVAILABLE:
        return {}
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_raw_iov_receiver, args=(ports, names, sets_path, FLOOR_REPEATS), daemon=True)
    child.start()
    port = ports.get(timeout=60)
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(RAW_IOV_STREAMS)]
    sets, out = np.load(sets_path), {}
    for case in CASES:
        halves = _halves(_iov(src.array, sets[f"{case}_src"], sets[f"{case}_n"]))
        dst.array[:] = 0

        def once(halves=halves) -> None:
            _both(send_iov, conns, halves)
            if conns[0].recv(1) != b"k":
                raise SystemExit("raw iovec receiver went away")

        out[case] = timed(once, FLOOR_REPEATS, budget_s=1e9)
        check(case, src, dst, sets)
    for conn in conns:
        conn.close()
    child.join(10)
    return out


def copy_seconds(nbytes: int, repeats: int) -> float:
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    return statistics.median(timed(lambda: b.copy_(a), repeats))


# -- orchestration ---------------------------------------------------------------------------
def run_group(
    modes: list[tuple[str, str, dict]], env: dict, names: dict, sets_path: str, dst, src, sets, repeats: int
) -> dict[str, dict]:
    """One receiver process (one UCX setting) and a sender process per row, for each
    setting of one engine alone and for pd-transfer through it; seconds (or why not) per
    row and case."""
    kind = modes[0][1].split("-")[0]
    from pd_transfer.transport.engines.registry import engine_unusable

    problem = engine_unusable(kind) if kind != "builtin" else ""
    if problem:
        return {label: {case: problem for case in CASES} for label, _, _ in modes}
    child_env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), **env)
    child_env.setdefault("UCX_MODULES", "^ib")
    me = [sys.executable, __file__]
    receiver = subprocess.Popen(
        me + ["--child", json.dumps({"role": "receiver", "kind": kind, "dst": names["dst"]})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env,
        stderr=subprocess.DEVNULL,
    )
    address = json.loads(receiver.stdout.readline())["address"]

    def start_sender(settings: dict) -> subprocess.Popen:
        settings = dict(settings)
        sender_env = dict(child_env, **settings.pop("env", {}))
        return subprocess.Popen(
            me
            + [
                "--child",
                json.dumps(
                    {
                        "role": "sender",
                        "src": names["src"],
                        "dst": names["dst"],
                        "sets": sets_path,
                        "address": address,
                        "repeats": repeats,
                        "settings": settings,
                    }
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=sender_env,
            stderr=subprocess.DEVNULL,
        )

    out: dict[str, dict] = {label: {} for label, _, _ in modes}  # and "chosen": pd-transfer's
    try:
        # one sender process per mode: an engine's threads (NIXL's progress thread, UCX's)
        # live as long as its agent, and an agent left from the mode before slowed the
        # next one down (whichever ran second measured 0.5-0.7x of the first)
        for label, mode, settings in modes:
            sender = start_sender(settings)
            try:
                for case in CASES:
                    dst.array[:] = 0
                    sender.stdin.write(f"{case} {mode}\n")
                    sender.stdin.flush()
                    line = sender.stdout.readline()
                    if not line:
                        out[label][case] = "sender failed"
                        break
                    answer = json.loads(line)
                    out[label][case] = answer["seconds"]
                    if "strategy" in answer:
                        out.setdefault("chosen", {})[(label, case)] = answer
                    if "ratio" in answer:
                        out.setdefault("pairs", {})[(label, case)] = answer
                    check(case, src, dst, sets)
            finally:
                sender.stdin.close()
                sender.wait(60)
    finally:
        receiver.stdin.close()
        receiver.wait(60)
    return out


def check(case: str, src, dst, sets) -> None:
    s, d, n = sets[f"{case}_src"], sets[f"{case}_dst"], sets[f"{case}_n"]
    run = int(n[0])
    if len(n) == 1:
        same = np.array_equal(src.array[:run], dst.array[:run])
    else:
        rows = np.dtype((np.void, run))
        same = np.array_equal(src.array.view(rows)[s // run], dst.array.view(rows)[d // run])
    if not same:
        raise SystemExit(f"case {case}: destination bytes are wrong")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every group this many times, rows in turn (reversed every other round), "
        "and report the median of the rounds: an engine's settings and pd-transfer through "
        "it then share the host's noise",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated groups to run: " + ", ".join(name for name, _, _ in GROUPS),
    )
    parser.add_argument("--cases", default="abc", help="which of the cases a, b, c to run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = json.loads(args.child)
        (receiver_main if child["role"] == "receiver" else sender_main)(child)
        return
    for case in [case for case in CASES if case not in args.cases]:
        del CASES[case]
    rng = np.random.default_rng(0)
    sets = {}
    for case in CASES:
        sets[f"{case}_src"], sets[f"{case}_dst"], sets[f"{case}_n"] = descriptors(case, rng)
    tag = uuid.uuid4().hex[:6]
    src, dst = (
        create_segment(f"pdt-ebench-{tag}-src", SRC_NBYTES),
        create_segment(f"pdt-ebench-{tag}-dst", DST_NBYTES),
    )
    try:
        src.array[:] = np.frombuffer(rng.bytes(SRC_NBYTES), np.uint8)
        with tempfile.TemporaryDirectory() as tmp:
            sets_path = os.path.join(tmp, "sets.npz")
            np.savez(sets_path, **sets)
            names = {"src": src.name, "dst": dst.name}
            only = set(filter(None, args.only.split(",")))
            groups = [group for group in GROUPS if not only or group[0] in only]
            report(args.repeats, args.rounds, groups, names, sets_path, src, dst, sets)
    finally:
        for segment in (src, dst):
            segment.close()
            segment.unlink()


def run_rounds(groups: list, rounds: int, names: dict, sets_path: str, src, dst, sets, repeats: int):
    """Every group ``rounds`` times, its rows in turn (reversed every other round); per row
    and case the median of the rounds' medians (or why it was not measured)."""
    per_round: dict[str, dict[str, list]] = {}
    chosen: dict = {}
    pairs: dict = {}
    for i in range(rounds):
        for _, env, rows in groups:
            group = run_group(rows[:: -1 if i % 2 else 1], env, names, sets_path, dst, src, sets, repeats)
            chosen.update(group.pop("chosen", {}))
            for key, answer in group.pop("pairs", {}).items():
                pairs.setdefault(key, []).append(answer)
            for label, cases in group.items():
                for case, seconds in cases.items():
                    per_round.setdefault(label, {}).setdefault(case, []).append(seconds)
    results = {
        label: {
            case: statistics.median(values)
            if all(isinstance(v, float) for v in values)
            else next(v for v in values if not isinstance(v, float))
            for case, values in cases.items()
        }
        for label, cases in per_round.items()
    }
    ratios = {key: statistics.median(a["ratio"] for a in answers) for key, answers in pairs.items()}
    chosen["ratios"] = ratios
    return results, chosen


def report(repeats: int, rounds: int, groups: list, names: dict, sets_path: str, src, dst, sets) -> None:
    totals = {case: int(sets[f"{case}_n"].sum()) for case in CASES}
    copy = {n: copy_seconds(n, repeats) for n in set(totals.values())}
    sizes = sorted(set(totals.values()))
    raw, raw_iov = raw_tcp_seconds(sizes), raw_iov_seconds(names, sets_path, src, dst)
    results, chosen = run_rounds(groups, rounds, names, sets_path, src, dst, sets, repeats)
    ratios = chosen.pop("ratios")
    fold_best(results, chosen)
    # the floors once more, at the end: right after the set-up (768 MiB of pools written,
    # the copy floor's tensors freed) the first one ran at half speed in some runs
    raw_again, iov_again = raw_tcp_seconds(sizes), raw_iov_seconds(names, sets_path, src, dst)
    raw_best = {n: min(t + raw_again[n]) for n, t in raw.items()}
    raw = {n: statistics.median(t + raw_again[n]) for n, t in raw.items()}
    raw_iov = {case: statistics.median(t + iov_again[case]) for case, t in raw_iov.items()}
    print(
        f"engines bench: median of {rounds} round(s), each the median of up to {repeats} "
        f"(fewer past 6 s; raw tcp floors: median of "
        f"{FLOOR_REPEATS} before and {FLOOR_REPEATS} after), {os.cpu_count()} CPUs, GB/s = 1e9 B/s; "
        f"ratios: x copy_ / x raw tcp / x the engine alone at its best (the fastest of its "
        f"settings, per case); pd-transfer rows: strategy auto, [the strategy it chose]; "
        f"machine shared with other work: figures are noisy"
    )
    print(f"{'case':<22}{'path':<{W}}{'ms':>9}{'GB/s':>8}{'x copy':>8}{'x tcp':>7}{'x alone':>9}")
    for case, (title, _, _) in CASES.items():
        total = totals[case]
        rows = [("torch copy_ (contiguous)", copy[total]), ("raw tcp (1 MiB sendall)", raw[total])]
        if case in raw_iov:
            rows.append(("raw tcp, 2 sockets, the case's iovecs", raw_iov[case]))
        rows += [(label, results[label][case]) for label in PRINTED if label in results]
        for i, (label, seconds) in enumerate(rows):
            first = title if i == 0 else ""
            shown = label + (f" [{chosen[(label, case)]['strategy']}]" if (label, case) in chosen else "")
            if not isinstance(seconds, float):
                print(f"{first:<22}{shown:<{W}}  {seconds}")
                continue
            alone = f"{ratios[(label, case)]:.2f}" if (label, case) in ratios else ""
            if label in ALONE:
                best = best_alone(results, label, case)
                alone = f"{best[1] / seconds:.2f}" if best else "-"
            print(
                f"{first:<22}{shown:<{W}}{seconds * 1e3:>9.1f}{total / seconds / 1e9:>8.2f}"
                f"{copy[total] / seconds:>8.2f}{raw[total] / seconds:>7.2f}{alone:>9}"
            )
    print("engine alone at its best, per case (what the x alone column divides by):")
    for label in (label for label in ALONE if label in results and label not in VARIANTS):
        picks = [(case, best_alone(results, label, case)) for case in CASES]
        print(
            f"  {label.removeprefix('pd-transfer '):<18}"
            + "; ".join(f"({case}) {best[0]}" if best else f"({case}) -" for case, best in picks)
        )
    print(
        "turns rows: pd-transfer and the engine alone on pd-transfer's own engine in turns "
        "(nixl: prepped lists, no progress thread; mooncake: sync batches of 1,024 and of "
        "65,536, the faster per turn); x alone: the median of the per-turn ratios"
    )
    targets(results, copy, raw, raw_best, raw_iov, totals)
    for (label, case), ratio in sorted(ratios.items()):
        verdict = "met" if ratio >= 0.9 else "MISSED"
        print(f"target {label.removeprefix('pd-transfer ')}, case {case}: {ratio:.2f}x  >= 0.9x  {verdict}")
    crossovers = {
        label: answer["crossover"]
        for (label, _), answer in chosen.items()
        if "(" in label and label not in VARIANTS
    }
    print(
        "staged below a mean run of: "
        + ", ".join(
            f"{label.removeprefix('pd-transfer ')} {value / 1024:.1f} KiB"
            for label, value in crossovers.items()
        )
        + " (measured by each link at connect)"
    )


def fold_best(results: dict, chosen: dict) -> None:
    """Each row of ``BEST_OF``: per case the fastest of its settings' rows, its strategy
    naming that setting (pd-transfer at its best, as the engine alone is taken at its)."""
    for best, variants in BEST_OF.items():
        measured = [label for label in variants if label in results]
        if not measured:
            continue
        results[best] = {}
        for case in CASES:
            timed_ = [(results[v][case], v) for v in measured if isinstance(results[v].get(case), float)]
            if not timed_:  # why it was not measured
                results[best][case] = results[measured[0]].get(case, "not measured")
                continue
            results[best][case], pick = min(timed_)
            answer = chosen.get((pick, case), {"strategy": "-", "crossover": 0.0})
            setting = pick.split(", ", 1)[1]
            chosen[(best, case)] = {**answer, "strategy": f"{answer['strategy']}, {setting}"}


def best_alone(results: dict, label: str, case: str) -> tuple[str, float] | None:
    """The fastest setting of the engine behind pd-transfer row ``label`` on ``case``:
    (its setting, seconds), or None where none was measured."""
    measured = [
        (results[peer][case], peer)
        for peer in ALONE[label]
        if isinstance(results.get(peer, {}).get(case), float)
    ]
    if not measured:
        return None
    seconds, peer = min(measured)
    return peer.split(", ", 1)[-1], seconds


def targets(results: dict, copy: dict, raw: dict, raw_best: dict, raw_iov: dict, totals: dict) -> None:
    """The issue's targets, as ratios of this run's rows (missing rows: not measured); an
    engine's row is its fastest setting on the case; the tcp x raw lines also say where
    the case stands against the floor's best run."""

    def mine(label: str, case: str) -> float | None:
        seconds = results.get(label, {}).get(case)
        return seconds if isinstance(seconds, float) else None

    def over_best(label: str, case: str, engine_row: str) -> float | None:
        best, seconds = best_alone(results, engine_row, case), mine(label, case)
        return best[1] / seconds if best and seconds else None

    tcp, shm = "pd-transfer tcp", "pd-transfer shm"
    moon, ntcp, nshm = (
        "pd-transfer mooncake (tcp)",
        "pd-transfer nixl (UCX tcp)",
        "pd-transfer nixl (UCX shm)",
    )
    checks = [
        (
            f"tcp x raw tcp, case {c}",
            raw[totals[c]] / results[tcp][c],
            0.7,
            f"  ({raw_best[totals[c]] / results[tcp][c]:.2f}x the floor's best run)",
        )
        for c in CASES
        if mine(tcp, c)
    ]
    checks += [
        (f"tcp x raw tcp iovecs, case {c}", raw_iov[c] / results[tcp][c], 0.9)
        for c in CASES
        if mine(tcp, c) and c in raw_iov
    ]
    checks += [
        ("tcp x mooncake TE tcp at best, 16 KiB", over_best(tcp, "b", moon), 4.0),
        ("tcp x nixl UCX tcp at best, 16 KiB", over_best(tcp, "b", ntcp), 1.5),
        ("tcp x mooncake TE tcp at best, 2 KiB", over_best(tcp, "c", moon), 20.0),
        ("tcp x nixl UCX tcp at best, 2 KiB", over_best(tcp, "c", ntcp), 6.0),
    ]
    peers = [best_alone(results, row, "a") for row in (moon, ntcp)]  # the engines over tcp
    peers = [best[1] for best in peers if best]
    if peers and mine(tcp, "a"):
        checks.append(("tcp x best tcp engine, 256 MiB block", min(peers) / results[tcp]["a"], 0.8))
    checks += [
        (f"pd {name} x {name} alone at best, case {c}", over_best(row, c, row), 0.9)
        for row, name in ((moon, "mooncake tcp"), (ntcp, "nixl UCX tcp"), (nshm, "nixl UCX shm"))
        for c in CASES
    ]
    checks += [
        ("shm x nixl UCX shm at best, 16 KiB", over_best(shm, "b", nshm), 2.0),
        ("shm x nixl UCX shm at best, 2 KiB", over_best(shm, "c", nshm), 5.0),
    ]
    checks += [
        (f"shm x copy_, case {c}", copy[totals[c]] / results[shm][c], floor)
        for c, floor in (("b", 0.6), ("c", 0.3))
        if mine(shm, c)
    ]
    for name, value, floor, *aside in checks:
        verdict = "not measured" if value is None else ("met" if value >= floor else "MISSED")
        shown = "-" if value is None else f"{value:.2f}x"
        print(f"target {name:<46} {shown:>8}  >= {floor:g}x  {verdict}{''.join(aside)}")


if __name__ == "__main__":
    main()
