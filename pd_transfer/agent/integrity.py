"""Integrity checks of rooms as the sidecars run them; the checksums are in
:mod:`pd_transfer.transport.copy.checksums`.

Who checks. A sidecar with ``integrity = true`` advertises the ``integrity``
feature in its Hello (only while its regions are host memory: the sums are
computed on the CPU). At verdict time prefill turns checking on for a decode
peer when both sides have it, and says so in the Verdict (``integrity``).
From then on every successful Done to that peer carries the room's
checksums, and decode verifies them against its own memory before it counts
the source as done. A mismatch fails the room with ``integrity_mismatch``,
naming the first bad block (pool, index, region, offset) and the source rank.

Only one side enabled: rooms go ahead unchecked, and the enabled side logs
that once per peer. A Done without the checksums its Verdict promised fails
the room (fail closed).

Sums are computed off the event loop (``asyncio.to_thread``): prefill after
each chunk is written, from its source bytes; decode once a source's Done
arrives, from the landed bytes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import TransportError
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import PoolChecksums
from pd_transfer.transport.copy.checksums import BlockLayout, IndexPair, RoomDigest, compare, landed_digest

if TYPE_CHECKING:
    from pd_transfer.agent.decode.room import PrefillInstance
    from pd_transfer.agent.prefill.chunks import ChunkRequests
    from pd_transfer.agent.prefill.records import Target
    from pd_transfer.layout.geometry import RankGeometry
    from pd_transfer.layout.reconcile import Reconciliation
    from pd_transfer.protocol import RankTable
    from pd_transfer.transport.regions import Regions

log = logging.getLogger(__name__)

FEATURE = "integrity"


def features(config: SidecarConfig, on_device: bool) -> tuple[str, ...]:
    """The Hello features this sidecar offers."""
    return (FEATURE,) if config.integrity and not on_device else ()


# -- prefill ------------------------------------------------------------------------


def prefill_layout(
    config: SidecarConfig, on_device: bool, planner: PairPlanner, decode_features: tuple[str, ...], peer: str
) -> BlockLayout | None:
    """The blocks to sum for a decode peer, or None when the pair does not check
    (``on_device``: this rank's regions are device memory)."""
    ours = FEATURE in features(config, on_device)
    theirs = FEATURE in decode_features
    converted = [pool.value for pool in Pool if planner.page_sizes(pool)]
    if ours and theirs and converted:
        # blocks are per destination page, and a converted page is filled by several
        # source pages: the pair moves unchecked, and says so
        log.warning(
            "integrity: rooms to %s are not checked: the page sizes of %s differ",
            peer,
            "/".join(converted),
            extra={"peer": peer},
        )
        return None
    if ours and theirs:
        return BlockLayout(planner)
    if config.integrity:
        log.warning(
            "integrity: rooms to %s are not checked: %s",
            peer,
            "its regions are device memory" if not ours else "the decode sidecar does not check integrity",
            extra={"peer": peer},
        )
    return None


async def sum_chunk(target: Target, requests: ChunkRequests, regions: Regions) -> None:
    """Fold one chunk's source bytes into the target's digest (before ``kv_cursor`` moves)."""
    layout = target.peer.integrity
    if layout is None:
        return
    if target.sums is None:
        target.sums = RoomDigest(layout, {pool: len(idx) for pool, idx in target.dst.items()})
    pairs: dict[Pool, IndexPair] = {}
    for pool, request in requests.items():
        if not isinstance(request, tuple):  # a span: prefill_layout checks no such pair
            raise ValueError(f"{pool.value}: a span of converted pages is not summed")
        pairs[pool] = request
    await asyncio.to_thread(target.sums.add_sent, pairs, {Pool.KV: target.kv_cursor}, regions)


def checksums(target: Target) -> tuple[PoolChecksums, ...]:
    """What a successful Done to this target carries (empty when the pair does not check)."""
    layout = target.peer.integrity
    if layout is None:
        return ()
    if target.sums is None:
        target.sums = RoomDigest(layout, {pool: len(idx) for pool, idx in target.dst.items()})
    return tuple(
        PoolChecksums(pool, tuple(d.items.tolist()), tuple(d.tensors.tolist()))
        for pool, d in target.sums.pools.items()
    )


# -- decode -------------------------------------------------------------------------


def attach_decode(
    config: SidecarConfig,
    on_device: bool,
    geometry: RankGeometry,
    instance: PrefillInstance,
    recon: Reconciliation,
    table: RankTable,
) -> None:
    """Give each source whose Verdict promised checksums the blocks to verify into this
    rank's ``geometry`` (``on_device``: its regions are device memory)."""
    ours = FEATURE in features(config, on_device)
    geometries = {e.geometry.rank_id: e.geometry for e in table.entries}
    for peer in instance.peers.values():
        if peer.rank_id not in instance.sources:
            continue
        promised = peer.verdict.result().integrity
        if ours and promised:
            peer.integrity = BlockLayout(PairPlanner(recon, geometries[peer.rank_id], geometry))
        elif config.integrity:
            log.warning(
                "integrity: rooms from %s are not verified: %s",
                peer.rank_id,
                "this sidecar's regions are device memory"
                if not ours
                else "the prefill sidecar does not send checksums",
                extra={"peer": peer.rank_id},
            )


async def verify(
    layout: BlockLayout, dst: dict[Pool, np.ndarray], sent: tuple[PoolChecksums, ...], regions: Regions
) -> str:
    """'' when what landed matches ``sent``; otherwise what differs."""
    if not sent:
        return "the Done carries no checksums although the Verdict promised them"
    by_pool = {c.pool: (np.asarray(c.items, np.uint32), np.asarray(c.tensors, np.uint32)) for c in sent}

    def check() -> str:
        return compare(layout, dst, by_pool, landed_digest(layout, dst, regions))

    try:
        return await asyncio.to_thread(check)
    except TransportError as err:
        return f"cannot read the landed bytes: {err.message}"
