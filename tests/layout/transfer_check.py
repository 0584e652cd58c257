"""Shared by the transfer tests: small models, random requests, plan + oracle check.

The oracle (pd_transfer.testing) is the ground truth; this module drives the
planner for every rank pair that must talk and asks the oracle whether the
destination bytes are exactly right.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.planner import plan_pair
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.spans import TokenSpan
from pd_transfer.layout.views import AxisRole, Layout, Pool
from pd_transfer.testing import World

# Small stand-ins for each model family, sized so one transfer takes milliseconds.
SMALL_MODELS = {
    "gqa": {
        "name": "tiny-gqa",
        "num_layers": 3,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 8, "head_dim": 4},
    },
    "gqa2": {
        "name": "tiny-gqa2",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 4},
    },
    "asym": {
        "name": "tiny-asym",
        "num_layers": 2,
        "layer_cycle": ["attention"],
        "attention": {"num_kv_heads": 4, "head_dim": 6, "v_head_dim": 4},
    },
    "mla": {
        "name": "tiny-mla",
        "num_layers": 3,
        "layer_cycle": ["mla"],
        "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
    },
    "swa": {
        "name": "tiny-swa",
        "num_layers": 4,
        "layer_cycle": ["sliding_attention", "attention"],
        "attention": {"num_kv_heads": 8, "head_dim": 4},
        "sliding_attention": {"num_kv_heads": 8, "head_dim": 4, "window_tokens": 8},
    },
    "gdn": {
        "name": "tiny-gdn",
        "num_layers": 4,
        "layer_cycle": ["gdn", "gdn", "gdn", "attention"],
        "attention": {"num_kv_heads": 2, "head_dim": 8},
        "gdn": {
            "num_key_heads": 8,
            "key_head_dim": 2,
            "num_value_heads": 16,
            "value_head_dim": 2,
            "conv_kernel": 4,
        },
    },
    "mamba2": {
        "name": "tiny-mamba2",
        "num_layers": 4,
        "layer_pattern": "M*M-M",
        "attention": {"num_kv_heads": 8, "head_dim": 4},
        "mamba2": {"num_heads": 16, "head_dim": 2, "state_size": 4, "n_groups": 8, "conv_kernel": 4},
    },
    "kda": {
        "name": "tiny-kda",
        "num_layers": 4,
        "layer_cycle": ["kda", "kda", "kda", "mla"],
        "mla": {"kv_lora_rank": 8, "qk_rope_head_dim": 4},
        "kda": {"num_heads": 8, "head_dim": 2, "conv_kernel": 4},
    },
    "side": {
        "name": "tiny-side",
        "num_layers": 2,
        "layer_cycle": ["gdn", "attention"],
        "attention": {"num_kv_heads": 8, "head_dim": 4},
        "gdn": {
            "num_key_heads": 8,
            "key_head_dim": 2,
            "num_value_heads": 8,
            "value_head_dim": 2,
            "conv_kernel": 3,
        },
        "side_states": [{"name": "side0", "num_elems": 5, "dtype": "float32"}],
    },
}
for _table in SMALL_MODELS.values():
    _table.setdefault("num_layers", len(_table.get("layer_pattern", "")))
SMALL_MODELS["mamba2"]["num_layers"] = 5

PAGE_SIZE = 4
NUM_PAGES = 6


def small_model(kind: str):
    return model_from_table(dict(SMALL_MODELS[kind]), f"<tiny {kind}>")


def instance(
    kind: str,
    role: Role,
    tp: int,
    *,
    pp: int = 1,
    layout: Layout = Layout.NHD,
    page_size: int = PAGE_SIZE,
    num_pages: int = NUM_PAGES,
    **extra,
) -> list[RankGeometry]:
    return build_instance(
        small_model(kind),
        role,
        tp,
        pp,
        page_size=page_size,
        kv_layout=layout,
        num_pages=num_pages,
        num_slots=3,
        num_aux_rows=2,
        **extra,
    )


def page_size(ranks: list[RankGeometry], pool: Pool) -> int | None:
    """Tokens per page of ``pool`` on one side (None: no token axis)."""
    return next(
        (
            v.extent(AxisRole.TOKEN)
            for g in ranks
            for v in g.views
            if v.pool is pool and v.extent(AxisRole.TOKEN) is not None
        ),
        None,
    )


def random_requests(
    prefill: list[RankGeometry], decode: list[RankGeometry], rng: np.random.Generator
) -> dict:
    """Distinct random indices per pool present on both sides.

    Where a token-paged pool's page sizes differ, a random token count sets
    each side's page count (``ceil(tokens / page_size)``); SWA then takes the
    request's last pages on each side, placed with a :class:`TokenSpan`.
    """
    requests = {}
    for pool in Pool:
        src = [v.index_count for g in prefill for v in g.views if v.pool is pool]
        dst = [v.index_count for g in decode for v in g.views if v.pool is pool]
        if not src or not dst:
            continue
        sizes = page_size(prefill, pool), page_size(decode, pool)
        if pool in (Pool.KV, Pool.SWA) and None not in sizes and sizes[0] != sizes[1]:
            requests[pool] = _token_request(pool, min(src), min(dst), sizes, rng)
            continue
        limit = min(min(src), min(dst))
        n = 1 if pool in (Pool.MAMBA, Pool.AUX) else int(rng.integers(1, limit + 1))
        requests[pool] = (rng.choice(min(src), n, replace=False), rng.choice(min(dst), n, replace=False))
    return requests


def _token_request(
    pool: Pool, src_pages: int, dst_pages: int, sizes: tuple[int, int], rng: np.random.Generator
):
    tokens = int(rng.integers(1, min(src_pages * sizes[0], dst_pages * sizes[1]) + 1))
    counts = [-(-tokens // size) for size in sizes]
    if pool is Pool.KV:
        return (
            rng.choice(src_pages, counts[0], replace=False),
            rng.choice(dst_pages, counts[1], replace=False),
        )
    # SWA: the request's last pages (at most a few) on each side
    last = [int(rng.integers(1, min(count, 3) + 1)) for count in counts]
    return TokenSpan(
        rng.choice(src_pages, last[0], replace=False),
        rng.choice(dst_pages, last[1], replace=False),
        (counts[0] - last[0]) * sizes[0],
        (counts[1] - last[1]) * sizes[1],
    )


def transfer_and_verify(prefill: list[RankGeometry], decode: list[RankGeometry], seed: int = 0) -> list[str]:
    """Reconcile (must accept), plan every needed rank pair, execute, and verify."""
    recon = reconcile(prefill, decode)
    if not recon.ok:
        raise AssertionError(f"expected acceptance, got:\n{recon.error()}")
    rng = np.random.default_rng(seed)
    requests = random_requests(prefill, decode, rng)
    world = World.build(prefill, decode, seed)
    by_id = {g.rank_id: g for g in prefill}
    for dst in decode:
        for src_id in recon.sources_for(dst):
            world.execute(plan_pair(recon, by_id[src_id], dst, requests))
    return world.verify(requests)
