"""Planner throughput: one 128k-token request on an 80-layer GQA model.

Times :func:`pd_transfer.layout.planner.plan_pair` for one request of 131072
tokens (8192 random distinct pages of 16 tokens out of a 10000-page pool) on
a Llama-3.1-70B-like model (80 layers, 8 KV heads, head_dim 128, bf16), NHD
device pools on both sides, for

  (a) same TP:   prefill tp 1 -> decode tp 1, rank pair 0 -> 0 (direct)
  (b) sliced TP: prefill tp 2 -> decode tp 8, rank pair 0 -> 0 (each page of
      one layer becomes one strided descriptor: 16 runs of one head)

and prints each beside a floor measured in the same run: the time numpy takes
to allocate and fill the plan's output arrays once (``src_offset`` and
``dst_offset``, int64, one per descriptor). The planner cannot do less than
write its output; the ratio plan/floor says how far above that it is.

Run: ``python benchmarks/plan_throughput.py [--repeats N]``. No assertions:
tests check correctness, this reports speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# run from a checkout without `pip install -e .`: import the package next to this script
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_transfer.layout.geometry import Role  # noqa: E402
from pd_transfer.layout.planner import plan_pair  # noqa: E402
from pd_transfer.layout.presets import model_from_table  # noqa: E402
from pd_transfer.layout.rank_builder import build_instance  # noqa: E402
from pd_transfer.layout.reconcile import reconcile  # noqa: E402
from pd_transfer.layout.views import Layout, Pool  # noqa: E402

LLAMA_70B_LIKE = {
    "name": "llama-3.1-70b-like",
    "num_layers": 80,
    "kv_dtype": "bfloat16",
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 8, "head_dim": 128},
}
TOKENS = 131072
PAGE_SIZE = 16
POOL_PAGES = 10000
TARGET_RATIO = 3.0
TARGET_UNSLICED_MS = 50.0


@dataclass(frozen=True)
class Case:
    label: str
    prefill_tp: int
    decode_tp: int


CASES = (Case("same TP 1->1", 1, 1), Case("sliced TP 2->8", 2, 8))


@dataclass(frozen=True)
class Row:
    label: str
    verdict: str
    reconcile_ms: float
    plan_ms: float
    floor_ms: float
    num_descriptors: int
    num_runs: int
    total_nbytes: int


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: caches, page faults, lazy imports
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def floor_fn(num_descriptors: int) -> Callable[[], object]:
    """Allocate and write once the two int64 offset arrays a plan must return."""
    pattern = np.arange(num_descriptors, dtype=np.int64)

    def floor() -> tuple[np.ndarray, np.ndarray]:
        src = np.empty(num_descriptors, np.int64)
        dst = np.empty(num_descriptors, np.int64)
        np.add(pattern, 4096, out=src)
        np.add(pattern, 8192, out=dst)
        return src, dst

    return floor


def run_case(case: Case, repeats: int, rng: np.random.Generator) -> Row:
    spec = model_from_table(LLAMA_70B_LIKE, "benchmarks/plan_throughput.py")
    shape = {"page_size": PAGE_SIZE, "kv_layout": Layout.NHD, "num_pages": POOL_PAGES}
    prefill = build_instance(spec, Role.PREFILL, case.prefill_tp, **shape)
    decode = build_instance(spec, Role.DECODE, case.decode_tp, **shape)
    num_pages = TOKENS // PAGE_SIZE
    src_pages = rng.choice(POOL_PAGES, num_pages, replace=False).astype(np.int64)
    dst_pages = rng.choice(POOL_PAGES, num_pages, replace=False).astype(np.int64)
    requests = {Pool.KV: (src_pages, dst_pages)}

    start = time.perf_counter()
    recon = reconcile(prefill, decode)
    reconcile_ms = (time.perf_counter() - start) * 1e3
    recon.raise_if_rejected()
    verdict = "/".join(sorted({v.mode.value for v in recon.verdicts if v.key[0] is Pool.KV}))

    plan = plan_pair(recon, prefill[0], decode[0], requests)
    plan_ms = median_ms(lambda: plan_pair(recon, prefill[0], decode[0], requests), repeats)
    floor_ms = median_ms(floor_fn(plan.num_descriptors), repeats)
    return Row(
        case.label,
        verdict,
        reconcile_ms,
        plan_ms,
        floor_ms,
        plan.num_descriptors,
        plan.num_runs,
        plan.total_nbytes,
    )


def render(rows: list[Row], repeats: int) -> str:
    lines = [
        f"plan_pair, one request of {TOKENS} tokens ({TOKENS // PAGE_SIZE} random pages of "
        f"{PAGE_SIZE} out of {POOL_PAGES}), {LLAMA_70B_LIKE['name']}: 80 layers, 8 KV heads, "
        f"head_dim 128, bf16, NHD both sides; median of {repeats} runs after a warm-up",
        f"{'case':<16} {'verdict':<8} {'reconcile ms':>12} {'plan ms':>9} {'descriptors':>11} "
        f"{'runs':>10} {'GiB':>6} {'desc/s':>10} {'floor ms':>9} {'plan/floor':>10}",
    ]
    for r in rows:
        rate = r.num_descriptors / (r.plan_ms / 1e3)
        lines.append(
            f"{r.label:<16} {r.verdict:<8} {r.reconcile_ms:>12.1f} {r.plan_ms:>9.1f} "
            f"{r.num_descriptors:>11} {r.num_runs:>10} {r.total_nbytes / 2**30:>6.2f} "
            f"{rate:>10.3g} {r.floor_ms:>9.2f} {r.plan_ms / r.floor_ms:>9.1f}x"
        )
    lines.append(
        "floor: numpy allocating and writing the two int64 offset arrays of the "
        "same number of descriptors once"
    )
    lines.append(f"target: within {TARGET_RATIO:.0f}x of floor; unsliced under {TARGET_UNSLICED_MS:.0f} ms")
    for r in rows:
        ratio = r.plan_ms / r.floor_ms
        missed = [f"{ratio:.1f}x floor"] if ratio > TARGET_RATIO else []
        if r.label == CASES[0].label and r.plan_ms > TARGET_UNSLICED_MS:
            missed.append(f"{r.plan_ms:.1f} ms")
        lines.append(f"  {r.label}: " + ("met" if not missed else "MISSED (" + ", ".join(missed) + ")"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per case (default 7)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = [run_case(case, args.repeats, rng) for case in CASES]
    print(render(rows, args.repeats))


if __name__ == "__main__":
    main()
