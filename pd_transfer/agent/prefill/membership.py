"""A prefill rank's place in its instance's rank table.

Rank 0 serves the table at the bootstrap address
(:class:`~pd_transfer.agent.bootstrap.BootstrapServer`); every rank announces
itself there and fetches the whole table, which its verdicts wait for
(:mod:`.acceptance`). A rank keeps announcing, so a restarted rank 0 rebuilds
its table from these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.agent.retry import Backoff
from pd_transfer.errors import PdTransferError

if TYPE_CHECKING:
    import zmq.asyncio

    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.protocol import RankEntry, RankTable

log = logging.getLogger(__package__)


class TableHolder(Protocol):
    """Where the complete rank table goes: the prefill side."""

    table: RankTable | None
    table_ready: asyncio.Event


async def announce_first(context: zmq.asyncio.Context, config: SidecarConfig, entry: RankEntry) -> None:
    """Announce this rank once before the worker's register returns, so a restarted
    rank is in the table before any new room can look it up (rank 0 may still be
    starting: then later)."""
    address = config.bootstrap
    if not address:
        log.error("prefill sidecar has no bootstrap address: decode cannot find this rank")
        return
    try:
        await fetch_table(
            context,
            address,
            config.agent_id,
            min(2.0, config.bootstrap_timeout_s),
            announce=entry,
            until_complete=False,
        )
    except PdTransferError as err:
        log.warning("prefill: first announcement failed (%s); retrying in the background", err.message)


async def join_instance(
    context: zmq.asyncio.Context, config: SidecarConfig, entry: RankEntry, holder: TableHolder
) -> None:
    """Fetch the complete rank table into ``holder``, then keep announcing ``entry``."""
    address = config.bootstrap
    if not address:
        return
    backoff = Backoff()
    while True:
        started = time.monotonic()
        try:
            holder.table = await fetch_table(
                context,
                address,
                config.agent_id,
                config.bootstrap_timeout_s,
                announce=entry,
            )
            if not holder.table_ready.is_set() or backoff.failures:
                log.info("prefill: rank table complete (%d ranks)", len(holder.table.entries))
            backoff.succeeded()
            holder.table_ready.set()
            # keep announcing: a restarted rank 0 rebuilds its table from these
            await asyncio.sleep(config.heartbeat_interval_s * config.heartbeat_misses)
        except PdTransferError as err:  # refused at once, or no table in time
            backoff.failed(started, err.message)
            log.log(
                logging.DEBUG if backoff.same_error else logging.WARNING,
                "prefill: %s; %s",
                err.message,
                backoff.describe(time.monotonic()),
            )
            await asyncio.sleep(backoff.wait_s(time.monotonic()))
