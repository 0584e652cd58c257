"""What the Mooncake and NIXL transports share: the link, its failure state, recovery.

An engine write is submitted in batches from a worker thread. One batch at a
time per link (``Link.lock``): the engines queue per peer, and a second
writer's batch on top of the first is what overflows the queue.

After an engine error neither engine can say whether the rest of the failed
submission is still in flight (Mooncake returns ``-1`` as soon as one task
fails, leaving the others running; there is no cancel). So the link
*settles*: it waits ``settle_s``, then probes the peer with a one-byte read.
A peer that answers leaves the link usable and the write fails with
``transport_failed``; a peer that never answers marks the link failed
(``peer_lost``), and every later write on it is refused at once. The settle
wait runs inside the write's background work, so :meth:`Link.drain` (what an
abort waits for before decode may reuse its pages) covers it.

A probe reads into :data:`PROBE_LANDING`, which lives as long as the
process. A probe the engine gave up on (a stopped peer, a deadline) has no
cancel either, and its byte may still arrive later, after the engine that
asked was closed and collected; it must land in memory nobody else owns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint, Transport
from pd_transfer.transport.engines.address import EngineAddress
from pd_transfer.transport.engines.strategy import PathCost, Strategy

if TYPE_CHECKING:
    from pd_transfer.transport.engines.staging.sender import StagingChannel

log = logging.getLogger(__name__)

PROBE_LANDING = np.zeros(64, np.uint8)  # every engine's probe reads land here (module docstring)


class StagingPath(Protocol):
    """What a link keeps of its staging channel (``staging/link_staging.py``'s ``LinkStaging``)."""

    by_region: dict[str, Strategy]  # destination region -> the strategy set for it
    channel: StagingChannel  # its ring: how many slots, how large (the strategy's choice)
    cost: PathCost | None  # the probed path, None when unmeasured

    def close(self) -> None: ...


@dataclass(frozen=True)
class Recovery:
    """How a link settles after an engine error (see the module docstring)."""

    settle_s: float = 1.0
    probe_attempts: int = 5
    probe_backoff_s: float = 0.5


class EngineLink(Link):
    """A peer reached through an engine: its published regions, a lock, a failure state."""

    #: descriptors the transport submits in one batch (NIXL: one request whatever its size)
    descriptors_per_batch: int = 1 << 30

    def __init__(self, transport: Transport, peer: PeerEndpoint, address: EngineAddress) -> None:
        super().__init__(transport, peer)
        self.address = address
        self.dst_bases = dict(address.regions)
        self.lock = threading.Lock()
        self.failed: TransportError | None = None
        self.num_batches = 0  # engine submissions so far
        self.max_batch_descriptors = 0  # the largest one
        self.staging: StagingPath | None = None  # when the peer offers staging
        self.nbytes_by_strategy: Counter[Strategy] = Counter()  # bytes written each way
        self.last_strategies: frozenset[Strategy] = frozenset()  # the last write's

    def set_strategy(self, dst_regions: Iterable[str], strategy: Strategy) -> None:
        """Write these destination regions ``strategy``'s way (the agent's per-pool choice).

        Ignored for staged when the peer offers no staging (the choice said direct).
        """
        if self.staging is not None:
            self.staging.by_region.update({r: strategy for r in dst_regions})

    def wrote(self, nbytes_by_strategy: dict[Strategy, int]) -> None:
        self.nbytes_by_strategy.update(nbytes_by_strategy)
        self.last_strategies = frozenset(s for s, n in nbytes_by_strategy.items() if n)

    def check_usable(self) -> None:
        self.check_open()
        if self.failed is not None:
            raise TransportError(
                f"link to {self.peer.peer_id} failed earlier and is not used again: {self.failed.message}",
                code=Reason.PEER_LOST,
                hint="the peer must register again (a new link)",
            )

    def counted(self, num_descriptors: int) -> None:
        self.num_batches += 1
        self.max_batch_descriptors = max(self.max_batch_descriptors, num_descriptors)

    async def _release(self) -> None:
        self.dst_bases = {}
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.close()  # the local ring goes with the link


def check_published(peer: PeerEndpoint, address: EngineAddress) -> None:
    """Every region the peer registered must be published, at least as large."""
    for handle in peer.regions:
        published = address.regions.get(handle.region_id)
        if published is None:
            raise TransportError(
                f"peer {peer.peer_id} registered region {handle.region_id!r} "
                f"with its geometry but not with its {address.kind} engine",
                code=Reason.UNKNOWN_REGION,
            )
        if published[1] < handle.nbytes:
            raise TransportError(
                f"peer {peer.peer_id} region {handle.region_id!r}: its "
                f"{address.kind} engine holds {published[1]} bytes, the geometry "
                f"says {handle.nbytes}",
                code=Reason.SEGMENT_TOO_SMALL,
            )
    if not address.regions:
        raise TransportError(
            f"peer {peer.peer_id} published no {address.kind} region", code=Reason.UNKNOWN_REGION
        )


def recover(link: EngineLink, recovery: Recovery, probe: Callable[[], bool], what: str) -> None:
    """Settle ``link`` after an engine error, then raise the write's error (always raises)."""
    time.sleep(recovery.settle_s)
    for attempt in range(recovery.probe_attempts):
        if probe():
            log.warning(
                "%s; %s answered a probe, link stays usable",
                what,
                link.peer.peer_id,
                extra={"peer": link.peer.peer_id},
            )
            raise TransportError(
                f"{what}; the peer answered a probe afterwards, so the link stays usable",
                code=Reason.TRANSPORT_FAILED,
                hint="bytes of this write may have landed in part: fail the room",
            )
        if attempt + 1 < recovery.probe_attempts:
            time.sleep(recovery.probe_backoff_s)
    link.failed = TransportError(
        f"{what}; the peer did not answer {recovery.probe_attempts} probes", code=Reason.PEER_LOST
    )
    log.warning("%s", link.failed.message, extra={"peer": link.peer.peer_id})
    raise link.failed
