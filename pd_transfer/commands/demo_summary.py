"""What ``pd-transfer demo`` prints about its run: the verdicts the sidecars agreed on,
checked before any process starts, and the summary of the workers' reports.

The verdicts are computed as the sidecars would (both instances built and
reconciled); invalid arguments raise :class:`~pd_transfer.errors.ConfigError`
naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED = 0, 1
VERDICT_WORDS = {
    "direct": "same layout, copied as is",
    "sliced": "a share of each tensor, between TP sizes",
    "replicated": "one elected writer of data every rank holds",
    "converted": "other strides or page size",
}


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-lines:])
    except OSError:
        return ""


def verdicts(args: argparse.Namespace) -> str:
    """The per-pool verdicts of this pairing: what every sidecar pair agreed on.

    ConfigError naming the argument when the model is unknown, an instance cannot be
    built (``--decode-tp 3`` with 8 KV heads) or the pair cannot be reconciled."""
    from pd_transfer.errors import ConfigError, PdTransferError, Reason
    from pd_transfer.layout.geometry import Role
    from pd_transfer.layout.presets import load_preset
    from pd_transfer.layout.rank_builder import build_instance
    from pd_transfer.layout.reconcile import reconcile
    from pd_transfer.layout.views import Layout

    try:
        spec = load_preset(args.model)
    except ConfigError as err:
        raise ConfigError(f"--model {args.model}: {err.message}", code=err.code, hint=err.hint) from None
    shape = {"page_size": args.page_size, "num_pages": 8, "num_slots": 1, "num_aux_rows": 1}
    instances = []
    for role, flag, tp, layout in (
        (Role.PREFILL, "--prefill-tp", args.prefill_tp, "nhd"),
        (Role.DECODE, "--decode-tp", args.decode_tp, args.kv_layout),
    ):
        try:
            instances.append(build_instance(spec, role, tp, kv_layout=Layout(layout), **shape))
        except PdTransferError as err:
            raise ConfigError(
                f"{flag} {tp}: {args.model}: {err.message}", code=err.code, hint=err.hint
            ) from None
    recon = reconcile(*instances)
    if not recon.ok:
        raise ConfigError(
            f"the prefill and decode instances cannot be reconciled: {recon.error()}",
            code=Reason.INVALID_CONFIG,
        )
    modes = recon.modes_by_pool()
    return ", ".join(
        f"{pool.value} " + "/".join(f"{m.value} x{n}" for m, n in by_mode.items())
        for pool, by_mode in modes.items()
    )


def summarise(
    args: argparse.Namespace, workdir: Path, workers: list[Any], elapsed_s: float, verdicts: str
) -> int:
    reports = []
    for worker in workers:
        path = workdir / f"{worker.name.removeprefix('worker-')}.report.json"
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            print(
                f"{worker.name}: no report (exit {worker.popen.returncode}); log tail:\n"
                f"{log_tail(worker.log_path)}",
                file=sys.stderr,
            )
            return EXIT_FAILED
    decode = [r for r in reports if r["role"] == "decode"]
    failed = [f for r in reports for f in r["failed"]]
    mismatches = sum(r["num_mismatches"] for r in decode)
    verified = sum(r["bytes_verified"] for r in decode)
    latencies = sorted(x for r in decode for x in r["latencies_s"])
    print()
    print(f"{'requests':<22}{args.requests}")
    print(
        f"{'decode rank-rooms':<22}{sum(r['succeeded'] for r in decode)} succeeded, "
        f"{len([f for r in decode for f in r['failed']])} failed"
    )
    print(f"{'bytes verified':<22}{verified / 2**30:.2f} GiB (every destination byte checked)")
    print(f"{'byte mismatches':<22}{mismatches}")
    print(f"{'verdicts':<22}{verdicts}")
    words = "; ".join(f"{mode}: {text}" for mode, text in VERDICT_WORDS.items() if f" {mode} x" in verdicts)
    print(f"{'':<22}(per pool, how its tensor pairs move x how many pairs; {words})")
    print(f"{'elapsed':<22}{elapsed_s:.1f} s")
    print(f"{'throughput':<22}{verified / elapsed_s / 1e9:.2f} GB/s (verified bytes / wall time)")
    if latencies:
        p50 = latencies[len(latencies) // 2]
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        print(f"{'room latency':<22}p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms (expect -> success)")
    for line in _rank_latencies(decode):
        print(line)
    for failure in failed[:10]:
        print(f"  failed room {failure['room']}: [{failure['code']}] {failure['reason']}")
    ok = all(r["ok"] for r in reports) and not mismatches and not failed
    print("result: OK" if ok else "result: FAILED")
    return EXIT_OK if ok else EXIT_FAILED


def _rank_latencies(decode: list[dict]) -> list[str]:
    """A row per decode rank: its rooms and their latency, expect to success."""
    if len(decode) < 2:
        return []
    lines = [f"  {'decode rank':<18}{'rooms':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"]
    for report in sorted(decode, key=lambda r: r["rank"]):
        latencies = sorted(report["latencies_s"])
        if not latencies:
            lines.append(f"  {report['rank']:<18}{report['succeeded']:>6}{'-':>10}{'-':>10}{'-':>10}")
            continue
        p50 = latencies[len(latencies) // 2]
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        lines.append(
            f"  {report['rank']:<18}{report['succeeded']:>6}{p50 * 1e3:>10.1f}{p99 * 1e3:>10.1f}"
            f"{latencies[-1] * 1e3:>10.1f}"
        )
    return lines
