"""Text reports for ``pd-transfer check`` and ``pd-transfer plan``.

Builds both instances' registrations from worker configs, reconciles them,
plans a sample request for every rank pair that must talk and renders the
result. Returns text; printing is the CLI's job.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from pd_transfer.config.worker_geometry import WorkerConfig
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.instance_reconcile import reconcile_instances
from pd_transfer.layout.lowering import RunBatch
from pd_transfer.layout.planner import PairPlanner, Request, plan_pair
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import Pool


def sample_requests(
    prefill: list[RankGeometry],
    decode: list[RankGeometry],
    tokens: int,
    page_size: int,
    swa_window: int | None,
) -> dict[Pool, Request]:
    """Index lists of one request of ``tokens`` tokens, for pools on both sides.

    ``page_size`` is prefill's; where decode's differs, each side gets the
    pages of its own size for the same tokens (SWA: the window's last pages,
    placed as a :class:`TokenSpan`).
    """
    pools = set().union(*(g.pools() for g in prefill)) & set().union(*(g.pools() for g in decode))
    capacity = {
        pool: [
            min(v.index_count for g in ranks for v in g.views if v.pool is pool)
            for ranks in (prefill, decode)
        ]
        for pool in pools
    }
    sizes = (page_size, decode[0].page_size if decode else page_size)
    requests: dict[Pool, Request] = {}
    for pool in pools:
        if pool not in (Pool.KV, Pool.SWA):
            idx = np.arange(1, dtype=np.int64)
            requests[pool] = (idx, idx[::-1].copy())
            continue
        fit = min(tokens, *(cap * size for cap, size in zip(capacity[pool], sizes)))
        counts = [math.ceil(fit / size) for size in sizes]
        if pool is Pool.SWA:
            window = [math.ceil((swa_window or size) / size) + 1 for size in sizes]
            last = [min(c, w) for c, w in zip(counts, window)]
            if sizes[0] != sizes[1]:
                requests[pool] = TokenSpan(
                    np.arange(last[0], dtype=np.int64),
                    np.arange(last[1], dtype=np.int64)[::-1].copy(),
                    (counts[0] - last[0]) * sizes[0],
                    (counts[1] - last[1]) * sizes[1],
                )
                continue
            counts = last
        requests[pool] = (
            np.arange(counts[0], dtype=np.int64),
            np.arange(counts[1], dtype=np.int64)[::-1].copy(),
        )
    return requests


def _window(config: WorkerConfig) -> int | None:
    """The model's sliding window in tokens (None without sliding-window layers)."""
    sliding = config.model.sliding_attention
    return None if sliding is None else sliding.window_tokens


def _count(request: Request) -> str:
    src, dst = (request.src_pages, request.dst_pages) if isinstance(request, TokenSpan) else request
    return str(len(src)) if len(src) == len(dst) else f"{len(src)}->{len(dst)}"


def _instances(prefill: WorkerConfig, decode: WorkerConfig):
    return prefill.build_ranks(), decode.build_ranks()


def _header(prefill: WorkerConfig, decode: WorkerConfig) -> list[str]:
    return [
        f"prefill: {prefill.describe()}  ({prefill.source})",
        f"decode:  {decode.describe()}  ({decode.source})",
    ]


def _modes_by_pool(recon: Reconciliation) -> dict[Pool, str]:
    modes: dict[Pool, set[str]] = defaultdict(set)
    for verdict in recon.verdicts:
        label = verdict.mode.value
        if (verdict.layout_changed or verdict.page_sizes) and verdict.mode.value != "converted":
            label += "+converted"
        if verdict.page_sizes:
            label += " pages {}->{}".format(*verdict.page_sizes)
        modes[verdict.key[0]].add(label)
    return {pool: "/".join(sorted(labels)) for pool, labels in modes.items()}


def verdict_report(
    prefill: list[RankGeometry], decode: list[RankGeometry]
) -> tuple[Reconciliation, list[str]]:
    """The verdict lines ``check`` prints for two instances' ranks."""
    recon = reconcile_instances(prefill, decode)
    if recon.ok:
        return recon, ["verdict: ACCEPTED"]
    return recon, ["verdict: REJECTED", str(recon.error())]


def check_report(prefill: WorkerConfig, decode: WorkerConfig, tokens: int) -> tuple[str, bool]:
    prefill_ranks, decode_ranks = _instances(prefill, decode)
    recon, verdict = verdict_report(prefill_ranks, decode_ranks)
    lines = _header(prefill, decode) + verdict
    if not recon.ok:
        return "\n".join(lines), False
    requests = sample_requests(prefill_ranks, decode_ranks, tokens, prefill.page_size, _window(prefill))
    modes = _modes_by_pool(recon)
    lines.append(
        "sample request: "
        + ", ".join(f"{pool.value} {_count(requests[pool])}" for pool in _ordered(requests))
    )
    lines.append(
        f"{'decode rank':<18} {'from prefill rank':<18} {'pool':<6} {'verdict':<22} "
        f"{'descriptors':>11} {'runs':>9} {'bytes':>12}"
    )
    by_rank = {g.rank_id: g for g in prefill_ranks}
    for dst in decode_ranks:
        for src_id in recon.sources_for(dst):
            planner = PairPlanner(recon, by_rank[src_id], dst)  # once per pair, as the sidecar does
            for pool in _ordered(requests):
                plan = planner.plan({pool: requests[pool]})
                if not plan.batches:
                    continue
                lines.append(
                    f"{dst.rank_id:<18} {src_id:<18} {pool.value:<6} {modes[pool]:<22} "
                    f"{plan.num_descriptors:>11} {plan.num_runs:>9} "
                    f"{_human_bytes(plan.total_nbytes):>12}"
                )
    return "\n".join(lines), True


def plan_report(
    prefill: WorkerConfig, decode: WorkerConfig, tokens: int, decode_rank: int, limit: int
) -> tuple[str, bool]:
    text, ok = check_report(prefill, decode, tokens)
    if not ok:
        return text, False
    prefill_ranks, decode_ranks = _instances(prefill, decode)
    recon = reconcile_instances(prefill_ranks, decode_ranks)
    targets = [g for g in decode_ranks if g.tp_rank == decode_rank]
    if not targets:
        return text + f"\nno decode rank with attn_tp rank {decode_rank}", False
    requests = sample_requests(prefill_ranks, decode_ranks, tokens, prefill.page_size, _window(prefill))
    lines = [text, ""]
    by_rank = {g.rank_id: g for g in prefill_ranks}
    for dst in targets:
        for src_id in recon.sources_for(dst):
            plan = plan_pair(recon, by_rank[src_id], dst, requests)
            lines.append(
                f"plan {src_id} -> {dst.rank_id}: {plan.num_descriptors} descriptors, "
                f"{plan.num_runs} runs, {_human_bytes(plan.total_nbytes)}"
            )
            lines.append(
                f"  {'src region':<16} {'dst region':<16} {'src off':>12} {'dst off':>12} "
                f"{'nbytes':>8} {'count':>6} {'src stride':>10} {'dst stride':>10}"
            )
            lines += _descriptor_lines(plan.batches, {v.region: v.pool for v in dst.views}, limit)
    return "\n".join(lines), True


def _descriptor_lines(batches: Sequence[RunBatch], pool_of: dict[str, Pool], limit: int) -> list[str]:
    """Up to ``limit`` descriptors of each pool (a batch's pool is its destination
    region's), then how many more that pool has."""
    lines: list[str] = []
    by_pool: dict[Pool, list[RunBatch]] = {}
    for batch in batches:
        by_pool.setdefault(pool_of[batch.dst_region], []).append(batch)
    for pool in _ordered(by_pool):
        shown, total = 0, sum(b.num_descriptors for b in by_pool[pool])
        for batch in by_pool[pool]:
            for i in range(min(batch.num_descriptors, limit - shown)):
                lines.append(
                    f"  {batch.src_region:<16} {batch.dst_region:<16} {batch.src_offset[i]:>12} "
                    f"{batch.dst_offset[i]:>12} {batch.nbytes[i]:>8} {batch.count[i]:>6} "
                    f"{batch.src_stride:>10} {batch.dst_stride:>10}"
                )
                shown += 1
        if total > shown:
            lines.append(f"  ... ({total - shown} more {pool.value} descriptors)")
    return lines


def _ordered(requests: Mapping[Pool, object]) -> list[Pool]:
    return [pool for pool in Pool if pool in requests]


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
