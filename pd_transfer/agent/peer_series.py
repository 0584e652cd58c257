"""The metric series labelled with a peer, removed once the peer has been gone a while.

Every peer rank id a sidecar meets gets its own series in the per-peer
families (``pd_transfer_peer_transfers_total``, ``..._peer_transfer_failures_total``,
``..._peer_heartbeat_misses_total``, ``pd_transfer_inflight_bytes``,
``pd_transfer_peer_heartbeat_age_seconds``, ``pd_transfer_strategy``). Peers
come and go (restarts, scale-downs, a stream of bogus sessions), and series
that are never removed grow the registry and every scrape without bound.
:class:`PeerSeries` remembers which series each peer has; once no session of
the peer is live (every record of it rejected or lost) for ``grace_s``, they
are removed. The totals stay in the families without a peer label
(``pd_transfer_transfers_total``, ``..._transfer_failures_total``,
``..._heartbeat_misses_total``). A peer that comes back within the grace
period keeps its series; one that comes back later starts them afresh.
"""

from __future__ import annotations

import time
from typing import TypeVar

from prometheus_client.metrics import MetricWrapperBase

MetricT = TypeVar("MetricT", bound=MetricWrapperBase)


class PeerSeries:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._gone_since: dict[str, float] = {}
        self._live: set[str] = set()

    def child(self, metric: MetricT, *labels: str, peer: str) -> MetricT:
        """``metric.labels(*labels)``, remembered as a series of ``peer`` (one of ``labels``).
        A series of a peer not live (a room failing after its peer was lost) goes with the
        peer's others, or ``grace_s`` from now."""
        self._series.setdefault(peer, set()).add((metric, labels))
        if peer not in self._live:
            self._gone_since.setdefault(peer, time.monotonic())
        return metric.labels(*labels)

    def live(self, peer: str) -> None:
        """A session of ``peer`` is connecting or accepted: its series stay."""
        self._live.add(peer)
        self._gone_since.pop(peer, None)

    def gone(self, peer: str) -> None:
        """No session of ``peer`` is live any more: its series go after the grace period."""
        self._live.discard(peer)
        self._gone_since.setdefault(peer, time.monotonic())

    def expired(self, peer: str) -> bool:
        since = self._gone_since.get(peer)
        return since is not None and time.monotonic() - since >= self.grace_s

    def in_grace(self, peer: str) -> bool:
        """``peer`` is gone, its series not removed yet."""
        return peer in self._gone_since and not self.expired(peer)

    def sweep(self) -> list[str]:
        """Remove the series of every peer gone for ``grace_s`` or longer; their ids."""
        swept = []
        for peer in [p for p in self._gone_since if self.expired(p)]:
            for metric, labels in self._series.pop(peer, ()):
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass  # removed already
            del self._gone_since[peer]
            swept.append(peer)
        return swept

    def peers(self) -> int:
        """Peers with series now (for tests and /status)."""
        return len(self._series)
