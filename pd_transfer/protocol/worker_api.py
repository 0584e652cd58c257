"""The worker <-> sidecar API: typed requests and replies over a local socket.

A GPU worker (or the simulated worker) talks to its own sidecar over a plain
Unix stream socket (``unix://``, frames of :mod:`.stream_frames`) or ZeroMQ
``ipc://`` (a DEALER in the worker, a ROUTER in the sidecar). Every request is
one msgpack map ``{"op": ..., "id": n, ...}``; the reply echoes ``id``. This
module is the contract between :mod:`pd_transfer.client` and the sidecar's
worker endpoint, and validates every field explicitly (the worker is a
separate process: its input is untrusted like any other).

Requests (fields beyond ``op`` and ``id``):

    register  geometry (geometry_codec dict), handles {region_id: segment},
              worker_id, pp_size (optional, default 1)
    send      room, pages [int], swa_pages [int], state_slots [int],
              aux_row int|None, last bool, stream bool (optional,
              default false: the chunk moves once layer_ready
              announced each of the rank's layers), decode str
              (optional: the decode instance the room is bound to)
                                                     (prefill)
    expect    room, bootstrap "tcp://host:port", pages, swa_pages,
              state_slots, aux_row                   (decode)
    layer_ready room, layer_id                       (prefill, streaming)
    poll      room
    wait      room, timeout_s   (replies when terminal or on timeout)
    abort     room              (decode: replies once no write can land)

Replies: ``{"id": n, "ok": True, ...}`` or ``{"id": n, "ok": False,
"code": reason code, "reason": text}``. ``poll``/``wait`` replies carry
``status`` (a :class:`RoomStatus` value) and, when failed, ``code`` and
``reason``; ``abort`` replies carry ``drained`` (True: the destination pages
are safe to reuse).

Sans-IO: no sockets here.
"""

from __future__ import annotations

import enum
import math
from typing import Any

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.protocol.geometry_codec import MAX_PP_SIZE
from pd_transfer.wire.envelope import pack, translated, unpack
from pd_transfer.wire.limits import MAX_ID_LEN, MAX_WORKER_REQUEST_NBYTES, WORKER_LIMITS

MAX_REQUEST_NBYTES = MAX_WORKER_REQUEST_NBYTES
MAX_INDEX = (1 << 62) - 1  # page, slot and row indices (int64 arithmetic stays exact)
MAX_ROOM = (1 << 64) - 1  # room ids are unsigned 64-bit, as on the wire
MAX_WAIT_S = 86400.0  # one wait's timeout (rooms time out long before)
MAX_INSTANCE_LEN = MAX_ID_LEN  # a decode instance's name (send's ``decode``)


class WorkerOp(enum.Enum):
    REGISTER = "register"
    SEND = "send"
    EXPECT = "expect"
    LAYER_READY = "layer_ready"
    POLL = "poll"
    WAIT = "wait"
    ABORT = "abort"


class WorkerApiError(PdTransferError):
    """A malformed worker request; the sidecar replies with this reason."""

    default_code = Reason.BAD_FRAME


_INDEX_FIELDS = ("pages", "swa_pages", "state_slots")

_REQUIRED: dict[WorkerOp, dict[str, tuple]] = {
    WorkerOp.REGISTER: {"geometry": (dict,), "handles": (dict,), "worker_id": (str,)},
    WorkerOp.SEND: {"room": (int,), "last": (bool,)},
    WorkerOp.EXPECT: {"room": (int,), "bootstrap": (str,)},
    WorkerOp.LAYER_READY: {"room": (int,), "layer_id": (int,)},
    WorkerOp.POLL: {"room": (int,)},
    WorkerOp.WAIT: {"room": (int,), "timeout_s": (int, float)},
    WorkerOp.ABORT: {"room": (int,)},
}


def encode(message: dict[str, Any]) -> bytes:
    return pack(message)


def decode_request(frame: bytes) -> tuple[WorkerOp, dict[str, Any]]:
    """Parse and validate one request; raise :class:`WorkerApiError` with the field."""
    try:
        message = unpack(frame, WORKER_LIMITS, "request")
    except ProtocolError as err:
        raise translated(err, WorkerApiError, "worker request", ()) from None
    if not isinstance(message, dict):
        raise WorkerApiError("request must be a map")
    try:
        op = WorkerOp(message.get("op"))
    except ValueError:
        raise WorkerApiError(
            f"at $.op: unknown op {message.get('op')!r}; accepted: {[o.value for o in WorkerOp]}"
        ) from None
    if not isinstance(message.get("id"), int) or isinstance(message.get("id"), bool):
        raise WorkerApiError("at $.id: expected int")
    try:
        return op, _validated(op, message)
    except WorkerApiError as err:
        err.request_id = message["id"]  # so the refusal reaches the call that made it
        raise


def _validated(op: WorkerOp, message: dict[str, Any]) -> dict[str, Any]:
    for name, kinds in _REQUIRED[op].items():
        value = message.get(name)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise WorkerApiError(
                f"at $.{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
            )
    if "room" in message and not 0 <= message["room"] <= MAX_ROOM:
        raise WorkerApiError(
            f"at $.room: expected an int in [0, 2**64), got {message['room']}", code=Reason.BAD_FIELD
        )
    timeout_s = message.get("timeout_s")
    if op is WorkerOp.WAIT and not (math.isfinite(timeout_s) and 0 <= timeout_s <= MAX_WAIT_S):
        raise WorkerApiError(
            f"at $.timeout_s: expected seconds in [0, {MAX_WAIT_S:.0f}], got {timeout_s!r}",
            code=Reason.BAD_FIELD,
        )
    for name in _INDEX_FIELDS:
        value = message.setdefault(name, [])
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INDEX for v in value
        ):
            raise WorkerApiError(f"at $.{name}: expected a list of ints in [0, 2**62)", code=Reason.BAD_FIELD)
    pp_size = message.setdefault("pp_size", 1)
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or not 1 <= pp_size <= MAX_PP_SIZE:
        raise WorkerApiError(f"at $.pp_size: expected an int in [1, {MAX_PP_SIZE}]")
    if not isinstance(message.setdefault("stream", False), bool):
        raise WorkerApiError("at $.stream: expected bool")
    decode = message.setdefault("decode", "")
    if not isinstance(decode, str) or len(decode) > MAX_INSTANCE_LEN:
        raise WorkerApiError(
            f"at $.decode: expected the decode instance's name, a string of at "
            f"most {MAX_INSTANCE_LEN} characters",
            code=Reason.BAD_FIELD,
        )
    aux_row = message.setdefault("aux_row", None)
    if aux_row is not None and (
        not isinstance(aux_row, int) or isinstance(aux_row, bool) or not 0 <= aux_row <= MAX_INDEX
    ):
        raise WorkerApiError("at $.aux_row: expected a non-negative int or nil")
    return message


def ok_reply(request_id: int, **fields: Any) -> bytes:
    return encode({"id": request_id, "ok": True, **fields})


def error_reply(request_id: int, error: PdTransferError) -> bytes:
    return encode({"id": request_id, "ok": False, "code": error.code.value, "reason": str(error)})
