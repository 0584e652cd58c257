"""The label values every sidecar exports at 0 from its start, per metric family.

A labelled counter has no series until its first increment, which alerts
and panels cannot see (:mod:`pd_transfer.observability.metrics` says why): these bounded
sets name the series :class:`~pd_transfer.observability.metrics.SidecarMetrics` exports
ahead. Pure data; the reason codes are :class:`~pd_transfer.errors.Reason`
values.
"""

from __future__ import annotations

from pd_transfer.errors import Reason

# label values exported at 0 from the start (see the module docstring)
BAD_FRAME_REASONS = tuple(
    r.value
    for r in (
        Reason.BAD_FRAME,
        Reason.FRAME_TOO_LARGE,
        Reason.LIMIT_EXCEEDED,
        Reason.BAD_FIELD,
        Reason.UNKNOWN_MESSAGE,
        Reason.VERSION_UNSUPPORTED,
        Reason.ILLEGAL_MESSAGE,
        Reason.ROLE_MISMATCH,
        Reason.STALE_GENERATION,
        Reason.BAD_GENERATION,
        Reason.DUPLICATE_ROOM,
        Reason.UNKNOWN_ROOM,
        Reason.UNAUTHENTICATED,
        Reason.TIMEOUT,
    )
)
AUTH_FAILURES = (Reason.AUTH_FAILED, Reason.AUTH_REPLAYED, Reason.UNAUTHENTICATED, Reason.IDENTITY_MISMATCH)
AUTH_FAILURE_REASONS = tuple(r.value for r in AUTH_FAILURES)
# the config keys whose limits fail requests (pd_transfer_limit_rejections_total{limit})
LIMITS = (
    "max_rooms",
    "max_rooms_per_peer",
    "max_chunks_per_room",
    "max_inflight_nbytes",
    "max_inflight_nbytes_total",
    "max_worker_requests",
)
ADMISSION_RESOURCES = ("rooms", "bytes")
DOORBELL_EVENTS = {"prefill": ("rang", "stale"), "decode": ("rung", "closed")}
# the sockets each role listens on (pd_transfer_connections_closed_total{socket})
LISTENING_SOCKETS = {"prefill": ("control", "bootstrap", "worker"), "decode": ("worker", "data")}
# the sockets whose strangers a sidecar bounds, and why it ends one (agent/lobby.py)
STRANGER_SOCKETS = {"prefill": ("control", "bootstrap"), "decode": ()}
STRANGER_REFUSALS = ("pending_limit", "fd_reserve", "handshake_timeout", "nbytes", "auth_refused")
