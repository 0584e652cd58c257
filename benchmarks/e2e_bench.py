"""Whole requests between sidecar processes, on every transport, beside the machine's limits.

    python benchmarks/e2e_bench.py [--tokens 8192] [--repeats 3] [--transports shm,tcp,...]

Two requests of ``--tokens`` tokens (page size 16, random pages), prefill TP 2
-> decode TP 4, each moved end to end: the prefill workers' send() to every
decode worker seeing Success, between real sidecar processes
(:class:`sidecar_bench.Deployment`):

  Llama-3.1-8B        KV of 32 layers (head slices: decode takes 2 of 4 heads)
  Qwen3-Next-80B-A3B  hybrid: KV of its 12 full-attention layers, plus one
                      state slot of its 36 GDN layers (conv state split by
                      shard group, temporal state by value head) and aux

over shm, tcp, and the mooncake and nixl transports where those engines are
installed (rows say when not). In the same run: a contiguous torch copy and
a raw loopback TCP stream of the same bytes (the floors); shm is compared
with the copy, the others with the socket. Medians of ``--repeats`` after a
warm-up room (bootstrap and verdicts excluded). Prints a table; no assertion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sidecar_bench import memcpy_gbps, raw_tcp_gbps, transfer_case  # noqa: E402

from pd_transfer.transport.engines.registry import ENGINES, engine_unusable  # noqa: E402

MODELS = [("Llama-3.1-8B", "llama-3.1-8b"), ("Qwen3-Next hybrid", "qwen3-next-80b-a3b")]


def unusable(transport: str) -> str:
    """Why ``transport`` cannot run here ('' when it can)."""
    return engine_unusable(transport) if transport in ENGINES else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transports", default="shm,tcp,mooncake,nixl", help="comma-separated, from shm, tcp, mooncake, nixl"
    )
    args = parser.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    workdir = Path(tempfile.mkdtemp(prefix="pdt-e2e-"))
    rows, sizes = [], {}
    for label, model in MODELS:
        for transport in transports:
            problem = unusable(transport)
            if problem:
                rows.append((label, transport, None, problem))
                continue
            print(f"... {label} over {transport}", file=sys.stderr, flush=True)
            seconds, nbytes = transfer_case(workdir, 2, 4, transport, args.tokens, args.repeats, model=model)
            sizes[label] = nbytes
            rows.append((label, transport, seconds, nbytes))
    floors = {
        label: (memcpy_gbps(n, args.repeats), statistics.median(raw_tcp_gbps(n, 1) for _ in range(3)))
        for label, n in sizes.items()
    }
    print(
        f"{args.tokens} tokens, page 16, prefill TP 2 -> decode TP 4, random pages; medians of {args.repeats}"
    )
    print(f"{'request':<20}{'path':<22}{'MiB':>8}{'seconds':>9}{'GB/s':>8}{'ratio':>8}  of")
    for label, (copy, tcp) in floors.items():
        mib = sizes[label] / 2**20
        print(
            f"{label:<20}{'torch copy_':<22}{mib:>8.0f}{sizes[label] / copy / 1e9:>9.3f}"
            f"{copy:>8.2f}{1:>8.2f}  memory floor"
        )
        print(
            f"{label:<20}{'raw tcp':<22}{mib:>8.0f}{sizes[label] / tcp / 1e9:>9.3f}"
            f"{tcp:>8.2f}{1:>8.2f}  network floor"
        )
    for label, transport, seconds, nbytes in rows:
        path = f"pd-transfer {transport}"
        if seconds is None:
            print(f"{label:<20}{path:<22}  not run: {nbytes}")
            continue
        copy, tcp = floors[label]
        rate = nbytes / seconds / 1e9
        floor, name = (copy, "copy") if transport == "shm" else (tcp, "raw tcp")
        print(
            f"{label:<20}{path:<22}{nbytes / 2**20:>8.0f}{seconds:>9.3f}{rate:>8.2f}"
            f"{rate / floor:>8.2f}  x {name}"
        )


if __name__ == "__main__":
    main()
