"""What operators see: peer states, readiness, the status document, metrics.

The role logic reports events here (a verdict, a finished or failed room, a
lost peer, a bad frame); this module keeps the peer book, feeds the
Prometheus metrics and answers ``/readyz`` and ``/status``. Gauges that mirror
live state (rooms by status, heartbeat ages) are refreshed at scrape time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from pd_transfer.layout.geometry import Role
from pd_transfer.metrics import SidecarMetrics
from pd_transfer.protocol import RoomStatus

PEER_STATES = ("connecting", "accepted", "rejected", "lost")
_MODE_ORDER = ("sliced", "replicated", "converted", "direct")


@dataclass
class PeerRecord:
    peer: str                  # the peer's rank id (also the metrics label)
    key: str = ""              # rank id and agent id: two sidecars may claim one rank id
    state: str = "connecting"
    reason: str = ""
    channel: object = None
    transport: str = ""
    mode: str = ""


class Observer:
    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.role = sidecar.config.role.value
        self.registry = CollectorRegistry()
        self.metrics = SidecarMetrics(self.registry, self.role)
        self.peers: dict[str, PeerRecord] = {}

    # -- events ---------------------------------------------------------------------
    def peer(self, peer: str, state: str, reason: str = "", channel=None, *, transport: str = "",
             modes: list[str] | None = None, key: str = "") -> None:
        key = key or (channel.label if channel is not None else "") or self._key_of(peer)
        record = self.peers.setdefault(key, PeerRecord(peer, key))
        record.state, record.reason = state, reason
        if channel is not None:
            record.channel = channel
        if transport:
            record.transport = transport
        if modes:
            record.mode = next((m for m in _MODE_ORDER if m in modes), modes[0])

    def _key_of(self, peer: str) -> str:
        """The record of ``peer`` (a rank id) that was touched last, else the rank id."""
        matches = [k for k, r in self.peers.items() if r.peer == peer]
        return matches[-1] if matches else peer

    def _record_of(self, peer: str) -> PeerRecord:
        accepted = [r for r in self.peers.values() if r.peer == peer and r.state == "accepted"]
        return accepted[-1] if accepted else self.peers.get(self._key_of(peer), PeerRecord(peer))

    def verdict(self, accepted: bool, reason: str = "") -> None:
        self.metrics.verdicts.labels(self.role, "accepted" if accepted else "rejected",
                                     reason or "none").inc()

    def verdict_modes(self, modes: dict[str, int]) -> None:
        for mode, count in modes.items():
            self.metrics.verdict_modes.labels(self.role, mode).inc(count)

    def transfer_done(self, peer: str, nbytes: int, descriptors: int, seconds: float) -> None:
        record = self._record_of(peer)
        m, role = self.metrics, self.role
        m.transfers.labels(role, peer, record.transport or "-", record.mode or "-", "success").inc()
        m.duration.labels(role).observe(seconds)
        if not nbytes:
            return  # decode sees durations; bytes are counted where they are written
        m.nbytes.labels(role).observe(nbytes)
        m.descriptors.labels(role).observe(descriptors)
        if seconds > 0:
            m.throughput.labels(role).observe(nbytes / seconds)

    def transfer_failed(self, peer: str, reason: str) -> None:
        record = self._record_of(peer)
        self.metrics.transfers.labels(self.role, peer, record.transport or "-", record.mode or "-",
                                      "failed").inc()
        self.metrics.failures.labels(self.role, peer, reason).inc()

    def abort(self, side: str, reason: str) -> None:
        self.metrics.aborts.labels(self.role, side, reason).inc()

    def lost(self, peer: str, silent_s: float, channel=None) -> None:
        self.metrics.heartbeat_misses.labels(self.role, peer).inc()
        key = (channel.label if channel is not None else "") or self._key_of(peer)
        if key in self.peers and self.peers[key].state == "rejected":
            return  # a rejected peer that went away stays rejected: that is what to fix
        self.peer(peer, "lost", f"no heartbeat for {silent_s:.1f} s", channel)

    def bad_frame(self, reason: str) -> None:
        self.metrics.bad_frames.labels(self.role, reason).inc()

    def auth_failure(self, reason: str) -> None:
        self.metrics.auth_failures.labels(self.role, reason).inc()

    def bootstrap(self, seconds: float) -> None:
        self.metrics.bootstrap.labels(self.role).observe(seconds)

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
        for record in self.peers.values():
            if record.channel is not None:
                m.heartbeat_age.labels(role, record.peer).set(now - record.channel.last_heard_s)
        geometry = self.sidecar.geometry
        if geometry is not None:
            by_pool: dict[str, int] = {}
            for view in geometry.views:
                by_pool[view.pool.value] = by_pool.get(view.pool.value, 0) + view.item_nbytes * view.index_count
            for pool, nbytes in by_pool.items():
                m.registered_bytes.labels(role, pool).set(nbytes)

    def ready(self) -> tuple[bool, dict]:
        sidecar = self.sidecar
        reasons = []
        if sidecar.geometry is None:
            reasons.append("the worker has not registered its pools")
        elif sidecar.config.role is Role.PREFILL and not sidecar.side.table_ready.is_set():
            reasons.append("the prefill rank table is incomplete (not every rank announced)")
        for address in sidecar.config.prefill_bootstraps:
            problem = sidecar.side.instance_problem(address)
            if problem:
                reasons.append(f"prefill instance {address}: {problem}")
        return (not reasons, {"ready": not reasons, "reasons": reasons})

    def status(self) -> dict:
        sidecar, now = self.sidecar, time.monotonic()
        geometry = sidecar.geometry
        rooms = [{"room": r.room, "status": r.status.value, "age_s": round(now - r.created_s, 3),
                  **({"reason": r.state.reason_text} if r.status is RoomStatus.FAILED else {})}
                 for r in sorted(sidecar.rooms.rooms.values(), key=lambda r: r.created_s)[-50:]]
        peers = [{"peer": p.peer, "state": p.state, "reason": p.reason, "transport": p.transport,
                  "mode": p.mode,
                  "last_heard_s": round(now - p.channel.last_heard_s, 3) if p.channel else None}
                 for p in self.peers.values()]
        return {"agent_id": sidecar.config.agent_id, "role": self.role,
                "rank": geometry.rank_id if geometry else None,
                "ready": self.ready()[0], "peers": peers, "rooms_by_status": sidecar.rooms.counts(),
                "rooms": rooms}
