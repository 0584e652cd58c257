"""Prometheus metrics of one sidecar, on an injected registry.

Nothing is created at import: :class:`SidecarMetrics` registers its metrics
on the registry it is given (a fresh ``CollectorRegistry`` per sidecar), so
tests and several sidecars in one process never collide. Names follow
Prometheus conventions (``pd_transfer_*``, base units); label sets are
bounded: ``peer`` is a peer rank id (``prefill[pp0,tp1]``), never a room id,
and ``reason`` is a stable :class:`~pd_transfer.errors.Reason` value. The
series with a ``peer`` label are removed once that peer has been gone for
``peer_series_grace_s`` (:mod:`pd_transfer.agent.peer_series`); the totals
are kept in families without one.

A labelled counter has no series until its first increment, and Prometheus's
``increase()`` cannot see the step from "absent" to 1: the first bad frame
would not fire an alert, and a panel would show "No data" where 0 is meant.
So every label combination known ahead is exported at 0 from the start: the
bounded reason codes, limits and events below, per role; and, through
:meth:`SidecarMetrics.peer_accepted`, the per-peer series of each peer once
accepted. (The alert rules also count a series born at its first event, for
the labels that cannot be known ahead.)

:data:`METRIC_NAMES` lists every exported family; the deployment tests check
that every metric the dashboard and the alert rules use is in it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_transfer import __version__
from pd_transfer.observability.metric_labels import (
    ADMISSION_RESOURCES,
    AUTH_FAILURE_REASONS,
    BAD_FRAME_REASONS,
    DOORBELL_EVENTS,
    LIMITS,
    LISTENING_SOCKETS,
    STRANGER_REFUSALS,
    STRANGER_SOCKETS,
)
from pd_transfer.protocol import PROTOCOL_VERSION

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 36, 2))
_RATE_BUCKETS = tuple(float(x) * 1e9 for x in (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32))
_COUNT_BUCKETS = tuple(float(1 << k) for k in range(0, 24, 2))


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        self.registry = registry
        self.role = role
        r = registry
        self._declare_outcomes(r)
        self._declare_room_shape(r)
        self._declare_occupancy(r)
        self._declare_peers(r)
        self._declare_negotiation(r)
        self._declare_losses(r)
        self._declare_health(r)
        self._export_known_series()

    def _declare_outcomes(self, r: CollectorRegistry) -> None:
        """Transfers and failed rooms, in total and per peer rank."""
        self.transfers = Counter(
            "pd_transfer_transfers",
            "Finished transfers (one per room and peer rank pair).",
            ["role", "transport", "mode", "outcome"],
            registry=r,
        )
        self.failures = Counter(
            "pd_transfer_transfer_failures",
            "Failed rooms by stable reason code.",
            ["role", "reason"],
            registry=r,
        )
        self.peer_transfers = Counter(
            "pd_transfer_peer_transfers",
            "Finished transfers by peer rank (series of a peer gone for peer_series_grace_s are removed).",
            ["role", "peer", "outcome"],
            registry=r,
        )
        self.peer_failures = Counter(
            "pd_transfer_peer_transfer_failures",
            "Failed rooms by peer rank and reason (series of "
            "a peer gone for peer_series_grace_s are removed).",
            ["role", "peer", "reason"],
            registry=r,
        )

    def _declare_room_shape(self, r: CollectorRegistry) -> None:
        """Per-room histograms: duration, size, rate, descriptors; bootstrap time."""
        self.duration = Histogram(
            "pd_transfer_transfer_duration_seconds",
            "Room duration from request to done.",
            ["role"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.nbytes = Histogram(
            "pd_transfer_transfer_bytes",
            "Bytes moved per room and peer pair.",
            ["role"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.throughput = Histogram(
            "pd_transfer_transfer_throughput_bytes_per_second",
            "Bytes per second per room.",
            ["role"],
            buckets=_RATE_BUCKETS,
            registry=r,
        )
        self.descriptors = Histogram(
            "pd_transfer_transfer_descriptors",
            "Copy descriptors per room and peer pair.",
            ["role"],
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.bootstrap = Histogram(
            "pd_transfer_bootstrap_duration_seconds",
            "Time to resolve a prefill instance: rank table, sessions, verdicts.",
            ["role"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )

    def _declare_occupancy(self, r: CollectorRegistry) -> None:
        """Rooms, registered and in-flight bytes, and admission under the limits."""
        self.rooms = Gauge("pd_transfer_rooms", "Rooms by status.", ["role", "state"], registry=r)
        self.registered_bytes = Gauge(
            "pd_transfer_registered_bytes",
            "Bytes registered by the worker, per pool kind.",
            ["role", "pool"],
            registry=r,
        )
        self.inflight_bytes = Gauge(
            "pd_transfer_inflight_bytes",
            "Bytes being written to a peer right now.",
            ["role", "peer"],
            registry=r,
        )
        self.admission_in_use = Gauge(
            "pd_transfer_admission_in_use",
            "Admitted under the limits now, summed over peers: "
            "rooms holding a per-peer slot, or bytes being written (resource).",
            ["role", "resource"],
            registry=r,
        )
        self.admission_peak = Gauge(
            "pd_transfer_admission_peak",
            "Highest pd_transfer_admission_in_use since the start.",
            ["role", "resource"],
            registry=r,
        )
        self.admission_waiting = Gauge(
            "pd_transfer_admission_waiting",
            "Rooms or chunk writes waiting for admission now.",
            ["role", "resource"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "pd_transfer_admission_wait_seconds",
            "Time from asking to admission (0: at once).",
            ["role", "resource"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.limit_rejections = Counter(
            "pd_transfer_limit_rejections",
            "Requests failed by a limit (config key): waited admission_wait_s in vain, or refused at once.",
            ["role", "limit"],
            registry=r,
        )

    def _declare_peers(self, r: CollectorRegistry) -> None:
        """Peers by state, and how long since each was heard."""
        self.peers = Gauge(
            "pd_transfer_peers",
            "Peers by state (connecting, accepted, rejected, lost, left).",
            ["role", "state"],
            registry=r,
        )
        self.heartbeat_age = Gauge(
            "pd_transfer_peer_heartbeat_age_seconds",
            "Seconds since the peer was last heard.",
            ["role", "peer"],
            registry=r,
        )

    def _declare_negotiation(self, r: CollectorRegistry) -> None:
        """What peers agreed: verdicts, copy modes, strategies, doorbells."""
        self.verdicts = Counter(
            "pd_transfer_verdicts",
            "Verdicts by outcome and reason.",
            ["role", "outcome", "reason"],
            registry=r,
        )
        self.verdict_modes = Counter(
            "pd_transfer_verdict_tensors",
            "Tensor pairs in accepted verdicts, by mode.",
            ["role", "mode"],
            registry=r,
        )
        self.strategy = Gauge(
            "pd_transfer_strategy",
            "How prefill moves each pool to each decode peer: 1 for the "
            "strategy in use (direct: a descriptor per run; staged: runs gathered into bulk "
            "transfers and scattered on arrival), 0 for the other.",
            ["role", "peer", "pool", "strategy"],
            registry=r,
        )
        self.doorbells = Counter(
            "pd_transfer_doorbells",
            "Same-host rooms and their doorbells. Prefill: rang (its bytes "
            "of a room landed), stale (the slot had moved on). Decode, when a room ends: rung (every "
            "writer rang, the worker needed no message), closed (this sidecar ended it: failed, or "
            "not every writer rings).",
            ["role", "event"],
            registry=r,
        )

    def _declare_losses(self, r: CollectorRegistry) -> None:
        """Rooms aborted and peers declared lost."""
        self.aborts = Counter(
            "pd_transfer_aborts",
            "Aborts by side that started them and reason.",
            ["role", "side", "reason"],
            registry=r,
        )
        self.heartbeat_misses = Counter(
            "pd_transfer_heartbeat_misses",
            "Peers declared lost (missed heartbeats, or a connection "
            "that closed and did not come back), sessions lost "
            "before they registered included.",
            ["role"],
            registry=r,
        )
        self.peer_heartbeat_misses = Counter(
            "pd_transfer_peer_heartbeat_misses",
            "Registered peers declared lost, by peer rank "
            "(series of a peer gone for peer_series_grace_s are removed).",
            ["role", "peer"],
            registry=r,
        )

    def _declare_health(self, r: CollectorRegistry) -> None:
        """The sidecar's own health: loop stalls, bad frames, connections, auth, build."""
        self.loop_stalls = Counter(
            "pd_transfer_loop_stall_seconds",
            "Seconds this sidecar's event loop woke later than a "
            "timer tick allows (starved of CPU, or blocked by a long call); peers' silence in them is "
            "not counted against their heartbeats.",
            ["role"],
            registry=r,
        )
        self.bad_frames = Counter(
            "pd_transfer_bad_frames",
            "Bad frames received, and data connections dropped before they authenticated, by reason.",
            ["role", "reason"],
            registry=r,
        )
        self.connections_closed = Counter(
            "pd_transfer_connections_closed",
            "Connections to a listening socket of this "
            "sidecar that ended, by socket (control, bootstrap, worker, data: decode's tcp data "
            "receiver): the peer left, or was dropped (a frame over the size limit, or one that "
            "could not be parsed).",
            ["role", "socket"],
            registry=r,
        )
        self.connections_refused = Counter(
            "pd_transfer_connections_refused",
            "Unauthenticated connections to the control or bootstrap socket that this sidecar "
            "ended, by socket and reason: pending_limit (too many strangers at once), fd_reserve "
            "(file descriptors near the limit), handshake_timeout, nbytes (sent too much before "
            "authenticating), auth_refused (its handshake or its name was refused).",
            ["role", "socket", "reason"],
            registry=r,
        )
        self.auth_failures = Counter(
            "pd_transfer_auth_failures",
            "Refused or failed authentication handshakes, and frames sent before one, by reason.",
            ["role", "reason"],
            registry=r,
        )
        self.insecure = Gauge(
            "pd_transfer_insecure",
            "1 when this sidecar serves without authentication "
            "(allow_insecure): anyone who reaches its ports may use it; 0 otherwise.",
            ["role"],
            registry=r,
        )
        self.unauthenticated_engine = Gauge(
            "pd_transfer_unauthenticated_engine",
            "1 when this sidecar runs an engine transport (mooncake, nixl) whose own listeners "
            "authenticate nobody, accepted with allow_unauthenticated_engine: anyone who reaches "
            "them can read and write the registered memory; 0 otherwise.",
            ["role"],
            registry=r,
        )
        self.build_info = Gauge(
            "pd_transfer_build_info", "Version of this sidecar.", ["version", "protocol_version"], registry=r
        )
        self.build_info.labels(__version__, f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}").set(1)

    def _export_known_series(self) -> None:
        """Every series whose labels are known before any event, at 0."""
        role = self.role
        for reason in BAD_FRAME_REASONS:
            self.bad_frames.labels(role, reason)
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(role, reason)
        for limit in LIMITS:
            self.limit_rejections.labels(role, limit)
        for resource in ADMISSION_RESOURCES:
            self.admission_wait.labels(role, resource)
        for event in DOORBELL_EVENTS.get(role, ()):
            self.doorbells.labels(role, event)
        for histogram in (self.duration, self.nbytes, self.throughput, self.descriptors, self.bootstrap):
            histogram.labels(role)
        self.heartbeat_misses.labels(role)
        for socket in LISTENING_SOCKETS[role]:
            self.connections_closed.labels(role, socket)
        for socket in STRANGER_SOCKETS[role]:
            for reason in STRANGER_REFUSALS:
                self.connections_refused.labels(role, socket, reason)
        self.loop_stalls.labels(role)
        self.verdicts.labels(role, "accepted", "none")

    def peer_accepted(self, peer: str, transport: str, mode: str) -> list[tuple]:
        """Export ``peer``'s series at 0 once it is accepted: its first lost heartbeat and its
        first transfer, success or failure, are then a step from 0. Returns the per-peer
        series made, as ``(metric, labels)``: the caller removes them once the peer is gone."""
        made: list[tuple[Counter, tuple[str, ...]]] = [(self.peer_heartbeat_misses, (self.role, peer))]
        for outcome in ("success", "failed"):
            self.transfers.labels(self.role, transport, mode, outcome)
            made.append((self.peer_transfers, (self.role, peer, outcome)))
        for metric, labels in made:
            metric.labels(*labels)
        return made


METRIC_NAMES = (
    "pd_transfer_transfers_total",
    "pd_transfer_transfer_failures_total",
    "pd_transfer_peer_transfers_total",
    "pd_transfer_peer_transfer_failures_total",
    "pd_transfer_peer_heartbeat_misses_total",
    "pd_transfer_transfer_duration_seconds",
    "pd_transfer_transfer_bytes",
    "pd_transfer_transfer_throughput_bytes_per_second",
    "pd_transfer_transfer_descriptors",
    "pd_transfer_bootstrap_duration_seconds",
    "pd_transfer_rooms",
    "pd_transfer_registered_bytes",
    "pd_transfer_inflight_bytes",
    "pd_transfer_admission_in_use",
    "pd_transfer_admission_peak",
    "pd_transfer_admission_waiting",
    "pd_transfer_admission_wait_seconds",
    "pd_transfer_limit_rejections_total",
    "pd_transfer_peers",
    "pd_transfer_peer_heartbeat_age_seconds",
    "pd_transfer_verdicts_total",
    "pd_transfer_verdict_tensors_total",
    "pd_transfer_strategy",
    "pd_transfer_doorbells_total",
    "pd_transfer_aborts_total",
    "pd_transfer_heartbeat_misses_total",
    "pd_transfer_loop_stall_seconds_total",
    "pd_transfer_bad_frames_total",
    "pd_transfer_connections_closed_total",
    "pd_transfer_connections_refused_total",
    "pd_transfer_auth_failures_total",
    "pd_transfer_insecure",
    "pd_transfer_unauthenticated_engine",
    "pd_transfer_build_info",
)
