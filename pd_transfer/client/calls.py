"""What each client call puts on the wire, and what it makes of the reply.

Shared by the blocking :class:`~pd_transfer.client.sync.Client` and the
:class:`~pd_transfer.client.aio.AsyncClient`: both build a request map here,
add an ``id``, send it with :func:`pd_transfer.protocol.worker_api.encode`,
and hand the matching reply back here. The request fields are those of
:mod:`pd_transfer.protocol.worker_api`.

Sans-IO: no sockets, no event loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from pd_transfer.client.errors import BadReply, Refused
from pd_transfer.client.status import RoomState, RoomStatus, reason_of
from pd_transfer.errors import ProtocolError
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.protocol.geometry_codec import geometry_to_data
from pd_transfer.protocol.worker_api import MAX_INDEX, MAX_INSTANCE_LEN, MAX_WAIT_S, WorkerOp
from pd_transfer.wire.envelope import unpack
from pd_transfer.wire.fields import clip_text
from pd_transfer.wire.limits import MAX_FAIL_TEXT_LEN, WORKER_LIMITS

Request = dict[str, Any]


# -- arguments ------------------------------------------------------------------

_PLAIN_MAX = 64  # index lists up to this long are checked without numpy
_INDEX_MAX = MAX_INDEX  # what the sidecar takes: refused here, before the request goes


def index_list(name: str, values: Iterable[int] | np.ndarray) -> list[int]:
    """``values`` as a list of non-negative Python ints; raises naming ``name``.

    Accepts lists, tuples, ranges and integer numpy arrays (converted in one
    vectorised step, not element by element).
    """
    plain = None if isinstance(values, np.ndarray) else list(values)
    if plain is not None and len(plain) <= _PLAIN_MAX and all(type(v) is int for v in plain):
        # a few pages (a 1-page room): plain Python, where numpy's conversions and
        # reductions would cost a worker woken from idle more than the whole check
        if plain and min(plain) < 0:
            raise ValueError(f"{name}: index {min(plain)} is negative")
        if plain and max(plain) > _INDEX_MAX:
            raise ValueError(f"{name}: index {max(plain)} is beyond any pool (at most {_INDEX_MAX})")
        return plain
    array = np.asarray(values if plain is None else plain)
    if array.size == 0:
        return []
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a flat list of indices, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        huge = [v for v in plain or () if type(v) is int and v > _INDEX_MAX]
        if huge:  # numpy made floats or objects of them
            raise ValueError(f"{name}: index {huge[0]} is beyond any pool (at most {_INDEX_MAX})")
        raise TypeError(f"{name}: expected integer indices, got {array.dtype}")
    if int(array.min()) < 0:
        raise ValueError(f"{name}: index {int(array.min())} is negative")
    if int(array.max()) > _INDEX_MAX:  # (uint64 would wrap to negative in int64)
        raise ValueError(f"{name}: index {int(array.max())} is beyond any pool (at most {_INDEX_MAX})")
    return array.astype(np.int64).tolist()


def room_id(room: int) -> int:
    if isinstance(room, bool) or not isinstance(room, (int, np.integer)):
        raise TypeError(f"room: expected an int, got {type(room).__name__}")
    return int(room)


def optional_index(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _INDEX_MAX:
        raise ValueError(f"{name}: expected an int in [0, {_INDEX_MAX}] or None, got {value!r}")
    return int(value)


# -- requests ---------------------------------------------------------------------


def register_request(
    geometry: RankGeometry, handles: Mapping[str, str], worker_id: str, pp_size: int = 1
) -> Request:
    """Register ``geometry``; ``handles`` names the shm segment of every region.

    ``pp_size`` is the instance's pipeline-parallel size: a prefill rank table
    is complete when ``attn_tp_size * pp_size`` ranks announced themselves.
    """
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")
    missing = [r.id for r in geometry.regions if r.id not in handles]
    unknown = sorted(set(handles) - {r.id for r in geometry.regions})
    if missing or unknown:
        raise ValueError(
            f"handles must name exactly the geometry's regions: missing {missing}, unknown {unknown}"
        )
    bad = [k for k, v in handles.items() if not isinstance(v, str) or not v]
    if bad:
        raise TypeError(f"handles: segment names of regions {bad} are not non-empty strings")
    return {
        "op": WorkerOp.REGISTER.value,
        "geometry": geometry_to_data(geometry),
        "handles": dict(handles),
        "worker_id": worker_id,
        "pp_size": pp_size,
    }


def send_request(
    room: int,
    pages,
    *,
    state_slots=(),
    aux_row: int | None = None,
    last_chunk: bool = True,
    swa_pages=(),
    stream: bool = False,
    decode: str = "",
) -> Request:
    request = {
        "op": WorkerOp.SEND.value,
        "room": room_id(room),
        "pages": index_list("pages", pages),
        "swa_pages": index_list("swa_pages", swa_pages),
        "state_slots": index_list("state_slots", state_slots),
        "aux_row": optional_index("aux_row", aux_row),
        "last": bool(last_chunk),
    }
    if stream:  # absent means False: older sidecars keep accepting the request
        request["stream"] = True
    if decode:  # absent: the room is bound to the first decode instance that claims it
        if not isinstance(decode, str) or len(decode) > MAX_INSTANCE_LEN:
            raise ValueError(
                f"decode: expected the decode instance's name (a string of at most "
                f"{MAX_INSTANCE_LEN} characters), got {decode!r:.80}"
            )
        request["decode"] = decode
    return request


def bootstrap_address(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"bootstrap_addr: expected an address like tcp://host:port, got {value!r}")
    return value


def expect_request(
    room: int,
    bootstrap_addr: str,
    pages,
    *,
    state_slots=(),
    aux_row: int | None = None,
    swa_pages=(),
    held_pages: int = 0,
) -> Request:
    return {
        "op": WorkerOp.EXPECT.value,
        "room": room_id(room),
        "bootstrap": bootstrap_address(bootstrap_addr),
        "pages": index_list("pages", pages),
        "swa_pages": index_list("swa_pages", swa_pages),
        "state_slots": index_list("state_slots", state_slots),
        "aux_row": optional_index("aux_row", aux_row),
        "held_pages": optional_index("held_pages", held_pages),
    }


def layer_ready_request(room: int, layer_id: int) -> Request:
    return {
        "op": WorkerOp.LAYER_READY.value,
        "room": room_id(room),
        "layer_id": optional_index("layer_id", layer_id),
    }


def poll_request(room: int) -> Request:
    return {"op": WorkerOp.POLL.value, "room": room_id(room)}


def wait_request(room: int, timeout_s: float) -> Request:
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 <= timeout_s <= MAX_WAIT_S
    ):  # (NaN compares False)
        raise ValueError(f"timeout_s: expected seconds in [0, {MAX_WAIT_S:.0f}], got {timeout_s!r}")
    return {"op": WorkerOp.WAIT.value, "room": room_id(room), "timeout_s": float(timeout_s)}


def abort_request(room: int) -> Request:
    return {"op": WorkerOp.ABORT.value, "room": room_id(room)}


def abandon_request(room: int, bootstrap_addr: str, reason: str) -> Request:
    return {
        "op": WorkerOp.ABANDON.value,
        "room": room_id(room),
        "bootstrap": bootstrap_address(bootstrap_addr),
        "reason": clip_text(str(reason), MAX_FAIL_TEXT_LEN),
    }


# -- replies ------------------------------------------------------------------------


def reply_id(frame: bytes) -> tuple[int | None, dict[str, Any] | None]:
    """``(id, reply)`` of a reply frame, ``(None, None)`` if it has no usable id.

    A frame without an id cannot be matched to a call, so the caller drops it
    (logging it) rather than failing an unrelated call.
    """
    try:
        reply = unpack(frame, WORKER_LIMITS, "reply")
    except ProtocolError:
        return None, None
    if not isinstance(reply, dict):
        return None, None
    request_id = reply.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, int):
        return None, None
    return request_id, reply


def checked(op: str, reply: dict[str, Any]) -> dict[str, Any]:
    """The reply if ``ok``; raise :class:`Refused` with the sidecar's code and reason."""
    ok = reply.get("ok")
    if ok is True:
        return reply
    if ok is not False:
        raise BadReply(op, f"at $.ok: expected bool, got {type(ok).__name__}")
    code_text = reply.get("code")
    reason = reply.get("reason")
    if not isinstance(code_text, str) or not isinstance(reason, str):
        raise BadReply(op, "a refusal must carry string 'code' and 'reason'")
    raise Refused(op, reason, code=reason_of(code_text), code_text=code_text)


def room_state(op: str, reply: dict[str, Any]) -> RoomState:
    """The :class:`RoomState` in a ``poll``/``wait`` reply."""
    try:
        status = RoomStatus(reply.get("status"))
    except ValueError:
        raise BadReply(
            op, f"at $.status: unknown status {reply.get('status')!r}; known: {[s.value for s in RoomStatus]}"
        ) from None
    if status is not RoomStatus.FAILED:
        return RoomState(status)
    code_text = reply.get("code")
    reason = reply.get("reason")
    code_text = code_text if isinstance(code_text, str) else None
    return RoomState(status, reason_of(code_text), reason if isinstance(reason, str) else "", code_text)


def drained(op: str, reply: dict[str, Any]) -> bool:
    value = reply.get("drained")
    if not isinstance(value, bool):
        raise BadReply(op, f"at $.drained: expected bool, got {type(value).__name__}")
    return value


__all__ = [
    "Request",
    "abandon_request",
    "abort_request",
    "checked",
    "drained",
    "expect_request",
    "index_list",
    "layer_ready_request",
    "poll_request",
    "register_request",
    "reply_id",
    "room_state",
    "send_request",
    "wait_request",
]
