"""Exception tree for pd-transfer, with stable reason codes.

Every error the project raises on purpose derives from :class:`PdTransferError`
and carries a ``code`` from :class:`Reason`. The code is stable: it is the
``reason`` label on failure metrics and travels on the wire, so renaming one is
a protocol change.

    PdTransferError                 base; .code, .hint
    ├── ConfigError                 a config file, preset or CLI value is invalid
    ├── GeometryError               a registration is malformed on its own
    │                               (view outside its region, bad shard range)
    ├── ReconcileError              two registrations cannot be reconciled;
    │                               .mismatches lists every difference found
    ├── PlanError                   a transfer request cannot be planned
    │                               (index counts differ, index out of range)
    ├── LayoutError                 an operation needs a layout the views lack
    │                               (page-granular copies on strided pages)
    ├── TransportError              a data plane cannot move bytes (run outside a
    │                               region, segment missing, peer refused a chunk)
    ├── AuthError                   a peer or worker failed authentication, or we
    │                               failed theirs; .reply is the frame to send back
    └── ProtocolError               a frame or message breaks the wire protocol;
        │                           .path names the field (``$.register...``)
        ├── LocalProtocolError      we tried to send something illegal (a bug
        │                           here; nothing was sent)
        └── RemoteProtocolError     the peer did; .reply is the message to send
                                    back (Close, Abort or a failed Done)

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Reason(enum.Enum):
    """Stable reason codes. The value is what goes on the wire and in metrics."""

    DTYPE_MISMATCH = "dtype_mismatch"  # the two sides store a tensor with different element types
    INNER_SHAPE_MISMATCH = "inner_shape_mismatch"  # a tensor's per-item shape differs (head_dim, state size)
    AXES_MISMATCH = "axes_mismatch"  # a tensor names its page, token or shard axes differently
    GLOBAL_EXTENT_MISMATCH = (
        "global_extent_mismatch"  # the sharded axis's full size differs between the sides
    )
    PAGE_SIZE_MISMATCH = "page_size_mismatch"  # tokens per page differ where no conversion applies
    SHARD_NOT_DIVISIBLE = "shard_not_divisible"  # a sharded axis does not split evenly over the TP size
    SHARD_RANGE_INVALID = "shard_range_invalid"  # a rank's [start, end) is empty, reversed or past the axis
    SHARD_GROUPS_MISMATCH = "shard_groups_mismatch"  # the sub-groups of a sharded axis differ (conv q|k|v)
    SHARD_GROUPS_MISSING = "shard_groups_missing"  # one side declares sub-groups, the other does not
    SHARD_METADATA_MISSING = "shard_metadata_missing"  # a sharded tensor lacks its global extent or range
    REPLICATION_MISMATCH = "replication_mismatch"  # one side replicates what the other shards
    SHARD_UNCOVERED = "shard_uncovered"  # no source rank holds part of a destination's range
    LAYER_MISSING = "layer_missing"  # a layer one side has and the other lacks
    TENSOR_DUPLICATE = "tensor_duplicate"  # one (pool, layer, name) registered twice
    INDEX_COUNT_MISMATCH = (
        "index_count_mismatch"  # prefill sends another number of pages or slots than decode expects
    )
    INDEX_OUT_OF_RANGE = "index_out_of_range"  # a page or slot index past the registered pool
    INDEX_REPEATED = "index_repeated"  # a destination names one page or slot twice
    INDEX_IN_USE = "index_in_use"  # a destination page or slot of another live room
    INDEX_NOT_PAGE_ALIGNED = "index_not_page_aligned"  # a token range that does not start on a page boundary
    VIEW_OUT_OF_REGION = "view_out_of_region"  # a registered view reaches past its region
    UNKNOWN_REGION = "unknown_region"  # a view names a region that was not registered
    BAD_VIEW = "bad_view"  # a view's shape, strides or axes do not describe a tensor
    LAYOUT_UNSUPPORTED = "layout_unsupported"  # a layout or pool kind this version cannot move
    INVALID_CONFIG = "invalid_config"  # a setting, flag or worker config that is refused
    UNKNOWN_PRESET = "unknown_preset"  # a model preset name that is not shipped
    # wire protocol (pd_transfer.protocol)
    BAD_FRAME = "bad_frame"  # not msgpack, not a map, no envelope
    FRAME_TOO_LARGE = "frame_too_large"  # a frame over the socket's size limit, dropped at its header
    LIMIT_EXCEEDED = "limit_exceeded"  # list, string, map or nesting too big
    BAD_FIELD = "bad_field"  # missing field, wrong type or value
    UNKNOWN_MESSAGE = "unknown_message"  # type tag this version does not know
    VERSION_UNSUPPORTED = "version_unsupported"  # peer speaks another major version
    ILLEGAL_MESSAGE = "illegal_message"  # message not allowed in this state
    ROLE_MISMATCH = "role_mismatch"  # prefill talking to prefill, ...
    STALE_GENERATION = "stale_generation"  # an older generation of a room
    BAD_GENERATION = "bad_generation"  # a generation not yet announced
    DUPLICATE_ROOM = "duplicate_room"  # a room requested twice
    NOT_ROOM_OWNER = "not_room_owner"  # a decode instance asked for another's room
    UNKNOWN_ROOM = "unknown_room"  # a message for a room this side does not hold
    SESSION_CLOSED = "session_closed"  # the peer ended the session (a Close) with rooms still needing it
    SESSION_FAILED = "session_failed"  # used after a protocol error
    ABORTED = "aborted"  # the worker aborted the room
    UNRECOGNIZED_REASON = "unrecognized_reason"  # a newer peer's code we do not know
    # runtime: rooms, peers
    PEER_REJECTED = "peer_rejected"  # the pair's layout verdict refused it: see every mismatch
    PEER_LOST = "peer_lost"  # the peer went silent or its connection broke
    TIMEOUT = "timeout"  # a room's deadline passed (waiting_timeout_s, transfer_timeout_s)
    TRANSPORT_FAILED = "transport_failed"  # the data plane could not connect or write
    NOT_REGISTERED = "not_registered"  # a worker call before the worker registered its pools
    ALREADY_REGISTERED = (
        "already_registered"  # a second registration while the first one's worker is connected
    )
    TOO_MANY_ROOMS = "too_many_rooms"  # max_rooms live rooms already: refused at once
    BACKPRESSURE_TIMEOUT = (
        "backpressure_timeout"  # waited admission_wait_s under a limit (agent/admission.py)
    )
    OVER_LIMIT = "over_limit"  # refused at once: a bounded queue is full
    BOOTSTRAP_FAILED = "bootstrap_failed"  # the prefill instance could not be resolved (rank table, verdicts)
    SHUTTING_DOWN = "shutting_down"  # the sidecar stopped before the room finished
    WORKER_LOST = "worker_lost"  # the worker's connection closed: it exited
    # data plane (pd_transfer.transport, pd_transfer.memory.segments)
    RUN_OUT_OF_REGION = "run_out_of_region"  # a byte run outside its region
    REGION_INVALID = "region_invalid"  # not a contiguous 1-D uint8 CPU tensor
    SEGMENT_NAME_INVALID = "segment_name_invalid"  # '/', '..' or other unsafe characters
    SEGMENT_NOT_FOUND = "segment_not_found"  # a registered shared-memory segment does not exist
    SEGMENT_EXISTS = "segment_exists"  # a new segment's name is taken
    SEGMENT_TOO_SMALL = "segment_too_small"  # smaller than the region it should hold
    SEGMENT_TRUNCATED = "segment_truncated"  # shrunk under its mapping after registration
    TRANSFER_INCOMPLETE = "transfer_incomplete"  # the receiver counted other bytes than sent
    LINK_CLOSED = "link_closed"  # the peer's data link closed under a write
    TRANSPORT_UNSUPPORTED = "transport_unsupported"  # the peer offers no handle for this transport
    INTEGRITY_MISMATCH = "integrity_mismatch"  # landed bytes differ from the checksums sent
    # authentication (pd_transfer.security)
    AUTH_FAILED = "auth_failed"  # a handshake proof did not verify (wrong key, tampered)
    AUTH_REPLAYED = "auth_replayed"  # a handshake nonce was used before
    UNAUTHENTICATED = "unauthenticated"  # a frame before the handshake finished (no key)
    IDENTITY_MISMATCH = "identity_mismatch"  # a peer claimed another name than its identity key's


@dataclass(frozen=True)
class Mismatch:
    """One difference between two sides, e.g. ``kv.layer[3].k.dtype``."""

    path: str
    code: Reason
    prefill: Any
    decode: Any
    hint: str = ""

    def render(self) -> str:
        return f"{self.path}: prefill={_show(self.prefill)} decode={_show(self.decode)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "code": self.code.value,
            "prefill": _show(self.prefill),
            "decode": _show(self.decode),
            "hint": self.hint,
        }


def _show(value: Any) -> str:
    if value is None:
        return "<missing>"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


class PdTransferError(Exception):
    """Base class. ``code`` is a :class:`Reason`; ``hint`` says how to fix it."""

    default_code = Reason.INVALID_CONFIG

    def __init__(self, message: str, *, code: Reason | None = None, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class ConfigError(PdTransferError):
    default_code = Reason.INVALID_CONFIG


class GeometryError(PdTransferError):
    default_code = Reason.BAD_VIEW


class PlanError(PdTransferError):
    default_code = Reason.INDEX_COUNT_MISMATCH


class LayoutError(PdTransferError):
    default_code = Reason.LAYOUT_UNSUPPORTED


class TransportError(PdTransferError):
    """A data plane could not move (all of) a plan's bytes; ``code`` says why."""

    default_code = Reason.TRANSPORT_FAILED


class AuthError(PdTransferError):
    """A handshake failed: wrong key, tampered or replayed proof, or no handshake at all.

    ``reply`` is the frame to send back to the peer (bytes of an auth result
    that says why), or None when nothing should be sent.
    """

    default_code = Reason.AUTH_FAILED

    def __init__(
        self, message: str, *, code: Reason | None = None, hint: str = "", reply: bytes | None = None
    ) -> None:
        super().__init__(message, code=code, hint=hint)
        self.reply = reply


class ReconcileError(PdTransferError):
    """Two registrations cannot be reconciled. Lists *every* mismatch found."""

    default_code = Reason.DTYPE_MISMATCH

    def __init__(self, headline: str, mismatches: list[Mismatch]) -> None:
        self.headline = headline
        self.mismatches = list(mismatches)
        hints = _unique(m.hint for m in self.mismatches if m.hint)
        lines = [f"{headline}: {len(self.mismatches)} mismatch" + ("es" if len(self.mismatches) != 1 else "")]
        lines += [f"  - {m.render()}  [{m.code.value}]" for m in self.mismatches]
        lines += [f"  hint: {h}" for h in hints]
        code = self.mismatches[0].code if self.mismatches else self.default_code
        super().__init__("\n".join(lines), code=code)

    def __str__(self) -> str:
        return self.message


class ProtocolError(PdTransferError):
    """A frame or message breaks the wire protocol.

    ``path`` locates the offending field msgspec-style (``$.register.geometry
    .views[2].strides_nbytes``), or is empty when the problem is not a field
    (an illegal message in a state). The message reads
    ``at <path>: <problem>``.
    """

    default_code = Reason.BAD_FRAME

    def __init__(self, problem: str, *, code: Reason | None = None, path: str = "", hint: str = "") -> None:
        self.problem = problem
        self.path = path
        super().__init__(f"at {path}: {problem}" if path else problem, code=code, hint=hint)


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids. Nothing was sent."""

    default_code = Reason.ILLEGAL_MESSAGE


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids.

    ``reply`` is the message the caller should send back (a protocol message
    object; typed loosely because this module imports nothing of the package).
    """

    default_code = Reason.ILLEGAL_MESSAGE

    def __init__(
        self, problem: str, *, code: Reason | None = None, path: str = "", hint: str = "", reply: Any = None
    ) -> None:
        super().__init__(problem, code=code, path=path, hint=hint)
        self.reply = reply


def _unique(items: Any) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
