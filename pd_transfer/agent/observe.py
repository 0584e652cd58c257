"""What operators see: peer states, readiness, the status document, metrics.

The role logic reports events here (a verdict, a finished or failed room, a
lost peer, a bad frame); this module keeps the peer book, feeds the
Prometheus metrics and answers ``/readyz`` and ``/status``. Gauges that mirror
live state (rooms by status, heartbeat ages) are refreshed at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import Gauge

from pd_transfer.agent.peer_series import PeerSeries
from pd_transfer.layout.geometry import Role
from pd_transfer.observability.metrics import SidecarMetrics
from pd_transfer.protocol import RoomStatus

if TYPE_CHECKING:
    from pd_transfer.agent.admission import Admission
    from pd_transfer.agent.auth import Security
    from pd_transfer.agent.channels import Channel, IncomingChannels
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.rooms import Room, RoomView
    from pd_transfer.agent.side import Readiness
    from pd_transfer.agent.worker_loss import WorkerBinding
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.geometry import RankGeometry
    from pd_transfer.layout.views import Pool
    from pd_transfer.protocol.messages import PoolPlan
    from pd_transfer.transport.engines.strategy import StrategyChoice

# lost: the peer went silent or its connection broke; left: its session ended in order
# (a Close from either side, its worker or this side's gone), which pages nobody
PEER_STATES = ("connecting", "accepted", "rejected", "lost", "left")
LIVE_STATES = ("connecting", "accepted")
PAST_STATES = ("rejected", "lost", "left")
MAX_PAST_PEERS = 64  # records of past peers, kept for /status (oldest go first)
_MODE_ORDER = ("sliced", "replicated", "converted", "direct")
STRATEGIES = ("direct", "staged")  # transport.strategy.Strategy's values


@dataclass
class PeerRecord:
    peer: str  # the peer's rank id (also the metrics label)
    key: str = ""  # rank id and agent id: two sidecars may claim one rank id
    state: str = "connecting"
    reason: str = ""
    channel: Channel | None = None
    transport: str = ""
    mode: str = ""


class Observed(Protocol):
    """What the observer reads of its sidecar (agent/sidecar.py), of either role."""

    @property
    def config(self) -> SidecarConfig: ...
    @property
    def security(self) -> Security: ...
    @property
    def geometry(self) -> RankGeometry | None: ...
    @property
    def worker(self) -> WorkerBinding: ...
    @property
    def dataplane(self) -> DataPlane: ...
    @property
    def side(self) -> Readiness: ...
    @property
    def rooms(self) -> RoomView[Room]: ...
    @property
    def control(self) -> IncomingChannels | None: ...
    @property
    def admission(self) -> Admission: ...


class Observer:
    def __init__(self, sidecar: Observed) -> None:
        self.sidecar = sidecar
        self.role = sidecar.config.role.value
        self.registry = CollectorRegistry()
        self.metrics = SidecarMetrics(self.registry, self.role)
        self.peers: dict[str, PeerRecord] = {}
        self.series = PeerSeries(sidecar.config.peer_series_grace_s)
        self.metrics.insecure.labels(self.role).set(0 if sidecar.security.enabled else 1)
        accepted = bool(sidecar.security.settings.unauthenticated_engine)
        self.metrics.unauthenticated_engine.labels(self.role).set(1 if accepted else 0)

    # -- events ---------------------------------------------------------------------
    def peer(
        self,
        peer: str,
        state: str,
        reason: str = "",
        channel: Channel | None = None,
        *,
        transport: str = "",
        modes: list[str] | None = None,
        key: str = "",
    ) -> None:
        key = key or (channel.label if channel is not None else "") or self._key_of(peer)
        record = self.peers.setdefault(key, PeerRecord(peer, key))
        record.state, record.reason = state, reason
        if channel is not None:
            record.channel = channel
        if transport:
            record.transport = transport
        if modes:
            record.mode = next((m for m in _MODE_ORDER if m in modes), modes[0])
        if state == "accepted":
            self._forget_past(peer, key)
            for metric, labels in self.metrics.peer_accepted(
                peer, record.transport or "-", record.mode or "-"
            ):
                self.series.child(metric, *labels, peer=peer)
        if state in PAST_STATES:
            self._prune()
        self._track(peer)

    def _forget_past(self, peer: str, key: str) -> None:
        """``peer`` is back (a new session accepted): its past records, lost, left or
        rejected, describe a session that no longer matters, and alerts on them resolve."""
        for old in [k for k, r in self.peers.items() if r.peer == peer and k != key]:
            if self.peers[old].state in PAST_STATES:
                self.peers.pop(old)

    def _prune(self) -> None:
        """Keep the newest :data:`MAX_PAST_PEERS` records of past peers: peers that come
        and go (restarts, or a stream of bogus sessions) must not grow the book forever."""
        past = [key for key, record in self.peers.items() if record.state in PAST_STATES]
        for key in past[: max(0, len(past) - MAX_PAST_PEERS)]:
            self.peers.pop(key)

    def _track(self, peer: str) -> None:
        """Keep ``peer``'s metric series while a session of it is live; else they go
        after the grace period (with those of other peers gone long enough)."""
        if any(r.peer == peer and r.state in LIVE_STATES for r in self.peers.values()):
            self.series.live(peer)
        else:
            self.series.gone(peer)
        self.series.sweep()

    def _key_of(self, peer: str) -> str:
        """The record of ``peer`` (a rank id) that was touched last, else the rank id."""
        matches = [k for k, r in self.peers.items() if r.peer == peer]
        return matches[-1] if matches else peer

    def _record_of(self, peer: str) -> PeerRecord:
        accepted = [r for r in self.peers.values() if r.peer == peer and r.state == "accepted"]
        return accepted[-1] if accepted else self.peers.get(self._key_of(peer), PeerRecord(peer))

    def verdict(self, accepted: bool, reason: str = "") -> None:
        self.metrics.verdicts.labels(
            self.role, "accepted" if accepted else "rejected", reason or "none"
        ).inc()

    def verdict_modes(self, modes: dict[str, int]) -> None:
        for mode, count in modes.items():
            self.metrics.verdict_modes.labels(self.role, mode).inc(count)

    def strategies(self, peer: str, decisions: Mapping[Pool, StrategyChoice]) -> None:
        """``{pool: StrategyChoice}`` chosen for ``peer`` (agent/strategies.py): 1 for the one in use."""
        for pool, decision in decisions.items():
            self._strategy(peer, pool.value, decision.strategy.value)

    def verdict_strategies(self, peer: str, plan: Iterable[PoolPlan]) -> None:
        """Decode: the strategies an accepted Verdict's plan summary reports."""
        for pool_plan in plan:
            self._strategy(peer, pool_plan.pool.value, pool_plan.strategy)

    def _strategy(self, peer: str, pool: str, chosen: str) -> None:
        if chosen not in STRATEGIES:  # not reported, or a newer peer's: labels stay bounded
            return
        for strategy in STRATEGIES:
            self.series.child(self.metrics.strategy, self.role, peer, pool, strategy, peer=peer).set(
                1 if strategy == chosen else 0
            )

    def inflight(self, peer: str) -> Gauge:
        """The gauge of bytes being written to ``peer`` (prefill)."""
        return self.series.child(self.metrics.inflight_bytes, self.role, peer, peer=peer)

    def transfer_done(self, peer: str, nbytes: int, descriptors: int, seconds: float) -> None:
        record = self._record_of(peer)
        m, role = self.metrics, self.role
        m.transfers.labels(role, record.transport or "-", record.mode or "-", "success").inc()
        self.series.child(m.peer_transfers, role, peer, "success", peer=peer).inc()
        m.duration.labels(role).observe(seconds)
        if not nbytes:
            return  # decode sees durations; bytes are counted where they are written
        m.nbytes.labels(role).observe(nbytes)
        m.descriptors.labels(role).observe(descriptors)
        if seconds > 0:
            m.throughput.labels(role).observe(nbytes / seconds)

    def transfer_failed(self, peer: str, reason: str) -> None:
        record = self._record_of(peer)
        m, role = self.metrics, self.role
        m.transfers.labels(role, record.transport or "-", record.mode or "-", "failed").inc()
        m.failures.labels(role, reason).inc()
        self.series.child(m.peer_transfers, role, peer, "failed", peer=peer).inc()
        self.series.child(m.peer_failures, role, peer, reason, peer=peer).inc()

    def doorbell(self, event: str) -> None:
        self.metrics.doorbells.labels(self.role, event).inc()

    def abort(self, side: str, reason: str) -> None:
        self.metrics.aborts.labels(self.role, side, reason).inc()

    def lost(self, peer: str, why: str, channel: Channel | None = None, *, missed: bool = True) -> None:
        """``peer``'s session is gone: silent or disconnected (``missed``), or closed by
        this side over a bad frame. A session that never registered has no record: only
        the total counts it."""
        key = (channel.label if channel is not None else "") or self._key_of(peer)
        if missed:
            self.metrics.heartbeat_misses.labels(self.role).inc()
        if key not in self.peers:
            return
        if missed:
            self.series.child(self.metrics.peer_heartbeat_misses, self.role, peer, peer=peer).inc()
        if channel is not None and self.peers[key].channel not in (None, channel):
            return  # an old session of a peer whose new session owns the record now
        if self.peers[key].state == "rejected":  # nothing flows with it, lost or not
            self.left(peer, f"its session ended: {why}", channel)
            return
        self.peer(peer, "lost", why, channel)

    def left(self, peer: str, why: str, channel: Channel | None = None) -> None:
        """``peer``'s session ended in order (``why``): a Close from either side. A peer
        that was rejected keeps that in its reason; no alert fires for a peer that left."""
        key = (channel.label if channel is not None else "") or self._key_of(peer)
        record = self.peers.get(key)
        if record is None or record.state in ("left", "lost"):
            return
        if channel is not None and record.channel not in (None, channel):
            return  # an old session of a peer whose new session owns the record now
        if record.state == "rejected":
            why = f"rejected, then left ({why}): {record.reason or 'no reason given'}"
        self.peer(peer, "left", why, channel)

    def bad_frame(self, reason: str) -> None:
        self.metrics.bad_frames.labels(self.role, reason).inc()

    def connection_closed(self, socket: str) -> None:
        """A connection to the listening socket ``socket`` ended (the peer left, or was dropped)."""
        self.metrics.connections_closed.labels(self.role, socket).inc()

    def connection_refused(self, socket: str, reason: str) -> None:
        """An unauthenticated connection to ``socket`` was ended (agent/lobby.py)."""
        self.metrics.connections_refused.labels(self.role, socket, reason).inc()

    def loop_stalled(self, seconds: float) -> None:
        self.metrics.loop_stalls.labels(self.role).inc(seconds)

    def auth_failure(self, reason: str) -> None:
        self.metrics.auth_failures.labels(self.role, reason).inc()

    def bootstrap(self, seconds: float) -> None:
        self.metrics.bootstrap.labels(self.role).observe(seconds)

    def watch_admission(self, admission: Admission) -> None:
        """Count admission waits and timeouts of the sidecar's limiters (agent/admission.py)."""
        for limiter in admission.limiters():
            limiter.on_admitted = lambda resource, waited_s: self.metrics.admission_wait.labels(
                self.role, resource
            ).observe(waited_s)
            limiter.on_timeout = lambda resource, limit, waited_s: self.limit_refused(limit)

    def limit_refused(self, limit: str) -> None:
        """A request failed by the limit named by its config key (``max_rooms_per_peer``)."""
        self.metrics.limit_rejections.labels(self.role, limit).inc()

    # -- scrape-time views ----------------------------------------------------------
    def render(self) -> bytes:
        self._refresh()
        return generate_latest(self.registry)

    def _refresh(self) -> None:
        m, role, now = self.metrics, self.role, time.monotonic()
        for state, count in self.sidecar.rooms.counts().items():
            m.rooms.labels(role, state).set(count)
        for state in PEER_STATES:
            m.peers.labels(role, state).set(sum(p.state == state for p in self.peers.values()))
        for limiter in self.sidecar.admission.limiters():
            m.admission_in_use.labels(role, limiter.resource).set(limiter.in_use_total)
            m.admission_peak.labels(role, limiter.resource).set(limiter.peak)
            m.admission_waiting.labels(role, limiter.resource).set(limiter.num_waiting)
        self.series.sweep()
        for record in self.peers.values():
            if record.channel is not None and (
                record.state in LIVE_STATES or self.series.in_grace(record.peer)
            ):
                self.series.child(m.heartbeat_age, role, record.peer, peer=record.peer).set(
                    now - record.channel.last_heard_s
                )
        geometry = self.sidecar.geometry
        if geometry is not None:
            by_pool: dict[str, int] = {}
            for view in geometry.views:
                by_pool[view.pool.value] = (
                    by_pool.get(view.pool.value, 0) + view.item_nbytes * view.index_count
                )
            for pool, nbytes in by_pool.items():
                m.registered_bytes.labels(role, pool).set(nbytes)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        sidecar = self.sidecar
        reasons = []
        if sidecar.geometry is None:
            reasons.append(sidecar.worker.lost_reason or "the worker has not registered its pools")
        elif (truncated := sidecar.dataplane.local_truncated()) is not None:
            reasons.append(
                f"{truncated.message}; every room fails segment_truncated until the worker "
                f"registers new pools (it closes its client and registers again)"
            )
        elif sidecar.config.role is Role.PREFILL and not sidecar.side.table_ready.is_set():
            reasons.append("the prefill rank table is incomplete (not every rank announced)")
        for address in sidecar.config.prefill_bootstraps:
            problem = sidecar.side.instance_problem(address)
            if problem:
                reasons.append(f"prefill instance {address}: {problem}")
        return (
            not reasons,
            {
                "ready": not reasons,
                "reasons": reasons,
                "insecure": not sidecar.security.enabled,
                "unauthenticated_engine": sidecar.security.settings.unauthenticated_engine or None,
            },
        )

    def status(self) -> dict[str, Any]:
        sidecar, now = self.sidecar, time.monotonic()
        geometry = sidecar.geometry
        rooms = [
            {
                "room": r.room,
                "status": r.status.value,
                "age_s": round(now - r.created_s, 3),
                **({"reason": r.state.reason_text} if r.status is RoomStatus.FAILED else {}),
            }
            for r in sorted(sidecar.rooms.rooms.values(), key=lambda r: r.created_s)[-50:]
        ]
        peers = [
            {
                "peer": p.peer,
                "state": p.state,
                "reason": p.reason,
                "transport": p.transport,
                "mode": p.mode,
                "last_heard_s": round(now - p.channel.last_heard_s, 3) if p.channel else None,
            }
            for p in self.peers.values()
        ]
        ready, readiness = self.ready()
        return {
            "agent_id": sidecar.config.agent_id,
            "role": self.role,
            "rank": geometry.rank_id if geometry else None,
            "ready": ready,
            "reasons": readiness["reasons"],
            "insecure": not sidecar.security.enabled,
            "unauthenticated_engine": readiness["unauthenticated_engine"],
            "engine_listeners": sidecar.dataplane.engine_listeners,
            "copies": sidecar.dataplane.copies,
            "control_sessions": len(sidecar.control.channels) if sidecar.control else None,
            "peers": peers,
            "rooms_by_status": sidecar.rooms.counts(),
            "rooms": rooms,
        }
