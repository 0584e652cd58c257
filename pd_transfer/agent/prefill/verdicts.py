"""The plan summary an accepted Verdict carries: per pool and mode, the cost of one item,
and how the pool moves (``strategy``: direct or staged, see :mod:`.strategies`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.errors import PdTransferError
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import Reconciliation
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import PoolPlan
from pd_transfer.transport.engines.strategy import StrategyChoice

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan


def plan_summary(
    recon: Reconciliation, planner: PairPlanner, strategies: Mapping[Pool, StrategyChoice] | None = None
) -> tuple[PoolPlan, ...]:
    """Tensors per (pool, mode), with descriptors and bytes of one page, slot or row.

    ``strategies``: ``{pool: StrategyChoice}`` (:func:`.strategies.choose_strategies`).
    """
    strategies = strategies or {}
    one_item = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    plans: dict[Pool, TransferPlan | None] = {}
    summary = []
    for (pool, mode), count in Counter((v.key[0], v.mode) for v in recon.verdicts).items():
        if pool not in plans:
            try:
                plans[pool] = planner.plan({pool: one_item})
            except PdTransferError:  # an empty pool on one side: nothing to summarise
                plans[pool] = None
        plan = plans[pool]
        if plan is not None:
            decision = strategies.get(pool)
            summary.append(
                PoolPlan(
                    pool,
                    mode,
                    count,
                    plan.num_descriptors,
                    plan.total_nbytes,
                    decision.strategy.value if decision is not None else "",
                )
            )
    return tuple(summary)
