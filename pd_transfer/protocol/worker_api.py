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
              state_slots, aux_row, held_pages int (optional, default
              0: the first held_pages of pages already hold the room's
              tokens, a prefix-cache hit; nothing is written into them)
                                                     (decode)
    layer_ready room, layer_id                       (prefill, streaming)
    poll      room
    wait      room, timeout_s   (replies when terminal or on timeout)
    abort     room              (decode: replies once no write can land)
    abandon   room, bootstrap, reason str (optional)  (decode: a room this
              rank will never expect, e.g. its request ended first; the
              sidecar tells the prefill instance, whose room fails with
              ``reason`` at once)

Replies: ``{"id": n, "ok": True, ...}`` or ``{"id": n, "ok": False,
"code": reason code, "reason": text}``. ``poll``/``wait`` replies carry
``status`` (a :class:`RoomStatus` value) and, when failed, ``code`` and
``reason``; ``abort`` replies carry ``drained`` (True: the destination pages
are safe to reuse).

The sidecar reads each request into its operation's record
(:mod:`.worker_requests`); clients and test doubles may read the checked map.

Sans-IO: no sockets here.
"""

from __future__ import annotations

import enum
from typing import Any

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.protocol.geometry_codec import MAX_PP_SIZE
from pd_transfer.wire.envelope import pack, translated, unpack
from pd_transfer.wire.fields import INT64_MAX, Bool, Field, Float, Int, ListOf, Map, Optional, Str, read_field
from pd_transfer.wire.limits import (
    MAX_ADDRESS_LEN,
    MAX_FAIL_TEXT_LEN,
    MAX_ID_LEN,
    MAX_INDICES,
    MAX_WORKER_REQUEST_NBYTES,
    WORKER_LIMITS,
)

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
    ABANDON = "abandon"


class WorkerApiError(PdTransferError):
    """A malformed worker request; the sidecar replies with this reason."""

    default_code = Reason.BAD_FRAME
    request_id: int = -1  # the request's id, once it was read (the reply carries it)


_ROOM = Int(hi=MAX_ROOM)
_INDICES = ListOf(Int(hi=MAX_INDEX), MAX_INDICES)

#: each op's required fields besides ``op`` and ``id``
_REQUIRED: dict[WorkerOp, tuple[Field, ...]] = {
    WorkerOp.REGISTER: (
        Field("geometry", Map()),
        Field("handles", Map()),
        Field("worker_id", Str(max_len=MAX_ID_LEN)),
    ),
    WorkerOp.SEND: (Field("room", _ROOM), Field("last", Bool())),
    WorkerOp.EXPECT: (Field("room", _ROOM), Field("bootstrap", Str(max_len=MAX_ADDRESS_LEN))),
    WorkerOp.LAYER_READY: (Field("room", _ROOM), Field("layer_id", Int(lo=-INT64_MAX - 1))),
    WorkerOp.POLL: (Field("room", _ROOM),),
    WorkerOp.WAIT: (Field("room", _ROOM), Field("timeout_s", Float())),
    WorkerOp.ABORT: (Field("room", _ROOM),),
    WorkerOp.ABANDON: (Field("room", _ROOM), Field("bootstrap", Str(max_len=MAX_ADDRESS_LEN))),
}

#: fields every request may carry, with their defaults
_OPTIONAL: tuple[Field, ...] = (
    Field("pages", _INDICES, default=[]),
    Field("swa_pages", _INDICES, default=[]),
    Field("state_slots", _INDICES, default=[]),
    Field("pp_size", Int(lo=1, hi=MAX_PP_SIZE), default=1),
    Field("stream", Bool(), default=False),
    Field("decode", Str(max_len=MAX_INSTANCE_LEN), default=""),
    Field("aux_row", Optional(Int(hi=MAX_INDEX)), default=None),
    Field("reason", Str(max_len=MAX_FAIL_TEXT_LEN), default=""),
    Field("held_pages", Int(hi=MAX_INDICES), default=0),
)


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
    """``message`` with every field checked (WorkerApiError naming it) and defaults filled.
    Lists are kept as sent (a send's pages go on to numpy as they are)."""
    try:
        for field in _REQUIRED[op] + _OPTIONAL:
            value = read_field(message, field, "$")
            if isinstance(value, tuple) and field.name in message:
                continue  # a list as sent, checked
            message[field.name] = list(value) if isinstance(value, list) else value
    except ProtocolError as err:
        raise WorkerApiError(err.message, code=err.code) from None
    timeout_s: float | None = message.get("timeout_s")  # a wait's is required: checked above
    if op is WorkerOp.WAIT and timeout_s is not None and timeout_s > MAX_WAIT_S:
        raise WorkerApiError(
            f"at $.timeout_s: expected seconds in [0, {MAX_WAIT_S:.0f}], got {timeout_s!r}",
            code=Reason.BAD_FIELD,
        )
    return message


def ok_reply(request_id: int, **fields: Any) -> bytes:
    return encode({"id": request_id, "ok": True, **fields})


def error_reply(request_id: int, error: PdTransferError) -> bytes:
    return encode({"id": request_id, "ok": False, "code": error.code.value, "reason": str(error)})
