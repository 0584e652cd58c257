"""Per peer pair and pool: direct runs or staging, chosen at verdict time and reported.

For an engine link (Mooncake, NIXL) the prefill sidecar profiles each pool's
runs on a sample plan (one item: a page, slot or row; index 0 on both sides,
as the verdict's plan summary does) and weighs them against the path the link
measured at connect (:func:`pd_transfer.transport.engines.strategy.choose`); the
choice is set on the link for the pool's destination regions, so every later
write of the pool goes that way. The other transports move bytes one way by
construction (shm: a copy per run, direct; tcp: runs streamed in chunks,
staged) and report that, so every verdict says how each pool moves.

The caller reports the result in the Verdict's plan summary, in the
``pd_transfer_strategy`` gauge and in the log. :func:`staging_options` and
:func:`receiver_staging` build both sides' staging settings from the
sidecar's configuration and security: the staging control channel runs the
same HMAC handshake as the tcp data plane (:class:`~.tcp_plane.DataAuth`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zmq.asyncio

from pd_transfer.agent.auth import security_of
from pd_transfer.agent.tcp_plane import DataAuth
from pd_transfer.errors import PdTransferError
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.views import Pool
from pd_transfer.transport.engines.link import EngineLink
from pd_transfer.transport.engines.staging.link_staging import ReceiverStaging, StagingOptions
from pd_transfer.transport.engines.staging.receiver import DEFAULT_SLOT_NBYTES
from pd_transfer.transport.engines.strategy import (
    INHERENT,
    RunProfile,
    StrategyChoice,
    StrategyMode,
    choose,
    joined_runs,
)

if TYPE_CHECKING:
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.lowering import TransferPlan
    from pd_transfer.transport.base import Link

log = logging.getLogger(__name__)


def _auth(context: zmq.asyncio.Context) -> tuple[DataAuth | None, float]:
    security = security_of(context)
    return (DataAuth(security) if security.enabled else None), security.handshake_timeout_s


def staging_options(config: SidecarConfig, context: zmq.asyncio.Context) -> StagingOptions:
    """The prefill side's: the configured strategy, authenticated staging channels."""
    auth, handshake_timeout_s = _auth(context)
    return StagingOptions(
        mode=StrategyMode(config.strategy),
        auth=auth,
        timeout_s=config.transfer_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
    )


def receiver_staging(
    config: SidecarConfig,
    context: zmq.asyncio.Context,
    on_bad_frame: Callable[[str], None] = lambda reason: None,
) -> ReceiverStaging:
    """The decode side's staging area (none under ``strategy = "direct"``) and channel,
    gated as the tcp data port is (``data_handshake_timeout_s``,
    ``max_pending_data_connections``)."""
    auth, _ = _auth(context)
    slots = 0 if config.strategy == StrategyMode.DIRECT.value else config.staging_slots
    return ReceiverStaging(
        slots,
        config.staging_slot_nbytes,
        bind_host=config.data_host,
        auth=auth,
        handshake_timeout_s=config.data_handshake_timeout_s,
        max_pending=config.max_pending_data_connections,
        on_bad_frame=on_bad_frame,
    )


def sample_plans(planner: PairPlanner) -> dict[Pool, TransferPlan]:
    """One item of every pool this pair moves, planned: ``{pool: TransferPlan}``."""
    one_item = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    plans: dict[Pool, TransferPlan] = {}
    for pool in Pool:
        if planner.unit_groups(pool):
            try:
                plans[pool] = planner.plan({pool: one_item})
            except PdTransferError:  # an empty pool on one side: nothing moves
                continue
    return plans


def choose_strategies(
    link: Link, planner: PairPlanner, mode: StrategyMode, transport: str
) -> dict[Pool, StrategyChoice]:
    """The strategy of each pool for ``link`` (set on engine links); ``transport`` names
    the link's kind for the others (``shm``, ``tcp``, ``device``)."""
    decisions: dict[Pool, StrategyChoice] = {}
    for pool, plan in sample_plans(planner).items():
        profile = RunProfile.of(joined_runs(plan)[1])
        if not isinstance(link, EngineLink):
            inherent = INHERENT.get(transport)
            if inherent is not None:
                decisions[pool] = StrategyChoice(inherent, f"inherent to {transport}", profile)
            continue
        staging = link.staging
        slot_nbytes = staging.channel.slot_nbytes if staging is not None else DEFAULT_SLOT_NBYTES
        decision = choose(
            profile,
            staging.cost if staging is not None else None,
            mode,
            slot_nbytes=slot_nbytes,
            staging=staging is not None,
            ring_slots=len(staging.channel.slots) if staging is not None else 1,
            batch_descriptors=link.descriptors_per_batch,
        )
        link.set_strategy({b.dst_region for b in plan.batches}, decision.strategy)
        decisions[pool] = decision
    for pool, decision in decisions.items():
        log.info(
            "strategy for %s pool %s: %s; %s",
            planner.dst.rank_id,
            pool.value,
            decision.describe(),
            decision.profile.describe() if decision.profile else "-",
            extra={"peer": planner.dst.rank_id},
        )
    return decisions
