"""The worker's requests as records: one frozen dataclass per operation.

:func:`read_request` is where the sidecar reads a worker's request: the frame is
decoded and every field checked by :mod:`.worker_api` (with the wire's field kinds,
errors naming the field), then the operation's own fields are taken into its
record. Nothing past this module indexes a request by name: the sidecar and its
sides are handed a :class:`SendRequest`, an :class:`ExpectRequest`, ... Fields an
operation does not use are checked all the same (a poll carrying a bad
``pp_size`` is refused as before) and left out of its record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from pd_transfer.protocol.worker_api import WorkerOp, decode_request


@dataclass(frozen=True)
class RegisterRequest:
    """``register``: the worker's geometry (geometry codec map), its regions' segments
    (region id -> segment name), its id and its instance's pipeline size."""

    id: int
    geometry: Mapping[Any, Any]
    handles: Mapping[Any, Any]
    worker_id: str
    pp_size: int


@dataclass(frozen=True)
class RoomPages:
    """The pages, slots and aux row a room's send or expect names, each list as sent."""

    id: int
    room: int
    pages: Sequence[int]
    swa_pages: Sequence[int]
    state_slots: Sequence[int]
    aux_row: int | None


@dataclass(frozen=True)
class SendRequest(RoomPages):
    """``send`` (prefill): one chunk of ``room``; ``last`` ends it, ``stream`` waits for
    its layers (``layer_ready``), ``decode`` names the decode instance it is bound to."""

    last: bool
    stream: bool
    decode: str


@dataclass(frozen=True)
class ExpectRequest(RoomPages):
    """``expect`` (decode): ``room`` comes from the prefill instance at ``bootstrap``; its
    first ``held_pages`` pages already hold the room's tokens."""

    bootstrap: str
    held_pages: int


@dataclass(frozen=True)
class LayerReadyRequest:
    """``layer_ready`` (prefill, streaming): ``layer_id`` of the room's latest chunk is computed."""

    id: int
    room: int
    layer_id: int


@dataclass(frozen=True)
class PollRequest:
    id: int
    room: int


@dataclass(frozen=True)
class WaitRequest:
    """``wait``: reply once ``room`` is terminal, or after ``timeout_s``."""

    id: int
    room: int
    timeout_s: float


@dataclass(frozen=True)
class AbortRequest:
    id: int
    room: int


@dataclass(frozen=True)
class AbandonRequest:
    """``abandon`` (decode): this rank will never expect ``room`` of the prefill instance
    at ``bootstrap``; ``reason`` is what that instance's room fails with."""

    id: int
    room: int
    bootstrap: str
    reason: str


WorkerRequest: TypeAlias = (
    RegisterRequest
    | SendRequest
    | ExpectRequest
    | LayerReadyRequest
    | PollRequest
    | WaitRequest
    | AbortRequest
    | AbandonRequest
)


def read_request(frame: bytes) -> WorkerRequest:
    """Decode, check and type one worker request; raises WorkerApiError naming the field."""
    op, request = decode_request(frame)
    return request_record(op, request)


def request_record(op: WorkerOp, request: dict[str, Any]) -> WorkerRequest:
    """The record of ``op`` from ``request`` as :func:`.worker_api.decode_request` checked it."""
    key, room = request["id"], request.get("room", 0)
    if op is WorkerOp.REGISTER:
        return RegisterRequest(
            key, request["geometry"], request["handles"], request["worker_id"], request["pp_size"]
        )
    if op is WorkerOp.SEND:
        return SendRequest(key, room, *_pages(request), request["last"], request["stream"], request["decode"])
    if op is WorkerOp.EXPECT:
        return ExpectRequest(key, room, *_pages(request), request["bootstrap"], request["held_pages"])
    if op is WorkerOp.LAYER_READY:
        return LayerReadyRequest(key, room, request["layer_id"])
    if op is WorkerOp.POLL:
        return PollRequest(key, room)
    if op is WorkerOp.WAIT:
        return WaitRequest(key, room, float(request["timeout_s"]))
    if op is WorkerOp.ABORT:
        return AbortRequest(key, room)
    return AbandonRequest(key, room, request["bootstrap"], request["reason"])


def _pages(request: dict[str, Any]) -> tuple[Sequence[int], Sequence[int], Sequence[int], int | None]:
    return request["pages"], request["swa_pages"], request["state_slots"], request["aux_row"]
