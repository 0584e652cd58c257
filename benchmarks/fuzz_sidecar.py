"""Longer fuzzing of a live prefill sidecar: a seeded mutation loop for N seconds.

    python benchmarks/fuzz_sidecar.py [--seconds 60] [--seed 1]

Starts a prefill TP 1 / decode TP 1 deployment of real sidecar processes on
127.0.0.1 and ipc:// (tests/agent/cluster.py), then, until the time is up,
sends mutated frames (random bytes, byte edits, field replacements of valid
frames; tests/fuzz/fuzz_frames.py) to the prefill sidecar's control socket
(each frame on a fresh session), worker endpoint and bootstrap socket. At the
end it checks what tests/fuzz checks, at a larger scale: the sidecars are
alive; every control frame its session refuses was counted in
``pd_transfer_bad_frames_total``; every worker request was answered, none by
an internal error; every table request got the real rank table; and a room
between the same sidecars moves byte-exact. Prints the frames tried per
socket and the sidecar's bad-frame counters; exits 1 if a check failed.

Well-formed Announce frames are not sent (an unauthenticated announce
replaces a rank's entry: an authentication matter, issue 5 item 1).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), *(str(ROOT / "tests" / d) for d in ("agent", "faults", "fuzz", "protocol"))]

import msgpack  # noqa: E402
from fault_tools import Deployments, kv_requests, metric_by_label, metric_total, tiny_ranks  # noqa: E402
from fuzz_frames import (  # noqa: E402
    FreshSessions,
    Target,
    bootstrap_kind,
    bootstrap_seeds,
    control_seeds,
    random_mutation,
    worker_kind,
    worker_seeds,
)
from protocol_samples import every_frame_type, rank_entry  # noqa: E402

from pd_transfer.client import RoomStatus  # noqa: E402
from pd_transfer.layout.geometry import Role  # noqa: E402
from pd_transfer.protocol import Close, RankTable, decode  # noqa: E402


def _bad_frames(cluster, rank: str) -> dict[str, float]:
    status, text = cluster.http(rank, "/metrics")
    return metric_by_label(text, "pd_transfer_bad_frames_total", "reason") if status == 200 else {}


# the fuzzer aims at the frame parsers behind authentication, so its sidecars open the door
# explicitly (tests/security checks what a sidecar with a secret refuses before the handshake)
INSECURE = {"allow_insecure": True}


def run(seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    deployments = Deployments()
    failures: list[str] = []
    try:
        cluster = deployments.make(
            tiny_ranks(Role.PREFILL, 1),
            tiny_ranks(Role.DECODE, 1),
            config={"bootstrap_timeout_s": 2.0, **INSECURE},
        )
        prefill = cluster.prefill[0]
        rank = prefill.rank_id
        control = FreshSessions("control", cluster.ready[rank]["control_address"])
        worker = Target("worker", cluster.sidecars[rank].endpoint)
        bootstrap = Target("bootstrap", cluster.bootstrap)
        seeds = {
            "control": control_seeds(every_frame_type()),
            "worker": worker_seeds(prefill, cluster.pools[rank].handles),
            "bootstrap": bootstrap_seeds(rank_entry()),
        }
        skipped: Counter = Counter()
        before = metric_total(cluster.http(rank, "/metrics")[1], "pd_transfer_bad_frames_total")
        started = time.monotonic()
        next_report = started + 10
        while time.monotonic() - started < seconds:
            socket = rng.choice(("control", "worker", "bootstrap"))
            frame = random_mutation(rng, seeds[socket])
            if socket == "control":
                control.send(frame, rng.random() < 0.5)
            elif socket == "worker":
                worker.send(frame, worker_kind(frame))
            else:
                kind = bootstrap_kind(frame)
                if kind == "announce":
                    skipped["bootstrap announce"] += 1
                    continue
                bootstrap.send(frame, kind)
            if time.monotonic() > next_report:
                next_report += 10
                total = control.sent + worker.sent + bootstrap.sent
                print(f"  {time.monotonic() - started:5.0f} s: {total} frames", flush=True)
                if any(s.proc.poll() is not None for s in cluster.sidecars.values()):
                    break

        # -- checks ---------------------------------------------------------------------
        wanted = worker.sent - worker.kinds["slow_wait"]
        if worker.drain_until(wanted, 30) < wanted:
            failures.append(f"worker endpoint answered {len(worker.replies)} of {wanted} requests")
        internal = [
            r
            for r in (msgpack.unpackb(x, raw=False) for x in worker.replies)
            if not r.get("ok") and str(r.get("reason", "")).startswith("internal error")
        ]
        kinds = Counter(r["reason"][:100] for r in internal)
        for reason, count in kinds.most_common():
            failures.append(f"{count} worker requests hit an internal error: {reason}")
        bootstrap.drain_until(bootstrap.kinds["table_request"], 30)
        bootstrap.drain(0.5)
        real = cluster.ready[rank]["control_address"]
        replies = [decode(reply) for reply in bootstrap.replies]
        tables = [r for r in replies if isinstance(r, RankTable)]
        if len(tables) != bootstrap.kinds["table_request"]:
            failures.append(f"{len(tables)} rank tables for {bootstrap.kinds['table_request']} requests")
        for reply in replies:  # a table, or a Close refusing a bad frame
            wrong_table = isinstance(reply, RankTable) and [e.control_address for e in reply.entries] != [
                real
            ]
            if wrong_table or not isinstance(reply, (RankTable, Close)):
                failures.append(f"bootstrap answered {reply!r:.200}")
                break
        counted_needed = control.kinds["counted"] + worker.kinds["bad"]
        deadline = time.monotonic() + 30
        counted = 0.0
        while time.monotonic() < deadline:
            counted = metric_total(cluster.http(rank, "/metrics")[1], "pd_transfer_bad_frames_total") - before
            if counted >= counted_needed:
                break
            time.sleep(0.1)
        if counted < counted_needed:
            failures.append(f"{counted:.0f} bad frames counted, {counted_needed} refused frames sent")
        for name, sidecar in cluster.sidecars.items():
            if sidecar.proc.poll() is not None:
                failures.append(f"{name} died: {sidecar.log.read_text()[-2000:]}")
        if not failures:
            requests = kv_requests([0, 5, 9, 15], [3, 2, 1, 0])
            room = 2**40 + 17
            cluster.expect(room, requests)
            cluster.send(room, requests)
            state = cluster.wait_decode(room)[cluster.decode[0].rank_id]
            if state.status is not RoomStatus.SUCCESS:
                failures.append(f"room after the fuzz: {state}")
            elif cluster.verify(requests):
                failures.append(f"room after the fuzz is not byte-exact: {cluster.verify(requests)[:3]}")

        elapsed = time.monotonic() - started
        total = control.sent + worker.sent + bootstrap.sent
        print(f"frames tried: {total} in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.0f}/s), seed {seed}")
        for target in (control, worker, bootstrap):
            print(f"  {target.name:9s} {target.sent:7d}  {dict(sorted(target.kinds.items()))}")
        if skipped:
            print(f"  not sent: {dict(skipped)}")
        print(f"  worker replies {len(worker.replies)}, table replies {len(bootstrap.replies)}")
        print(f"prefill bad_frames_total by reason: {dict(sorted(_bad_frames(cluster, rank).items()))}")
        worker.close()
        bootstrap.close()
    finally:
        leaks = deployments.close()
        failures += leaks
    for line in failures:
        print(f"FAILED: {line}")
    print("result:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    return run(args.seconds, args.seed)


if __name__ == "__main__":
    sys.exit(main())
