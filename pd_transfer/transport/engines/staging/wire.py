"""The staging control channel's requests: open a ring, and "slot k holds these runs".

Sans-IO: encoding and strict decoding only. The frames travel on a plain
socket with the tcp data plane's framing (:mod:`~pd_transfer.transport.tcp.sockets`: a 20-byte prefix,
then a msgpack header; no payload: the bytes went through the engine).
Prefill -> decode, as DATA frames::

    {"v": 1, "t": "open", "slots": 4}              ask for a ring of staging slots
    {"v": 1, "t": "staged", "slot": 2, "nbytes": 4194304, "chunk": <chunk header>}
                                                   slot 2 holds nbytes bytes: scatter them

``chunk`` is the tcp plane's chunk header (:mod:`~pd_transfer.transport.tcp.frames`: transfer id, room,
generation, sequence number and the destination runs), decoded by
:func:`~pd_transfer.transport.tcp.frames.decode_data` with all its checks.
Decode -> prefill, as REPLY frames: ``{"v": 1, "t": "ring", "slots": [...],
"slot_nbytes": n}`` for an open (no slots: the staging area is full), then
exactly one :class:`~pd_transfer.transport.tcp.frames.Ack` or
:class:`~pd_transfer.transport.tcp.frames.Fail` per staged chunk, in order.

A peer's frame is untrusted: every field is checked here and a bad one
raises :class:`TransportError` with BAD_FRAME naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.tcp.frames import ChunkHeader, decode_data
from pd_transfer.transport.tcp.frames import encode as encode_chunk

WIRE_VERSION = 1
MAX_RING_SLOTS = 64
MAX_HEADER_NBYTES = 8 << 20
_MAX_INT = 2**62


@dataclass(frozen=True)
class OpenRing:
    slots: int


@dataclass(frozen=True)
class Ring:
    """Staging slot indices granted to this connection (empty: none free) and their size."""

    slots: tuple[int, ...]
    slot_nbytes: int


@dataclass(frozen=True)
class Staged:
    slot: int
    nbytes: int
    chunk: ChunkHeader


def encode(message: OpenRing | Ring | Staged) -> bytes:
    if isinstance(message, OpenRing):
        body: dict[str, Any] = {"t": "open", "slots": message.slots}
    elif isinstance(message, Ring):
        body = {"t": "ring", "slots": list(message.slots), "slot_nbytes": message.slot_nbytes}
    elif isinstance(message, Staged):
        body = {
            "t": "staged",
            "slot": message.slot,
            "nbytes": message.nbytes,
            "chunk": encode_chunk(message.chunk),
        }
    else:
        raise TypeError(f"not a staging frame: {message!r}")
    return msgpack.packb({"v": WIRE_VERSION, **body}, use_bin_type=True)


def decode_request(frame: bytes) -> OpenRing | Staged:
    """A prefill side's request, checked field by field."""
    body = _envelope(frame, ("open", "staged"))
    if body["t"] == "open":
        slots = _int(body, "slots")
        if not 1 <= slots <= MAX_RING_SLOTS:
            raise _bad("slots", f"1 to {MAX_RING_SLOTS}")
        return OpenRing(slots)
    chunk = body.get("chunk")
    if not isinstance(chunk, bytes):
        raise _bad("chunk", "bytes holding a chunk header")
    header = decode_data(chunk)
    if not isinstance(header, ChunkHeader):
        raise _bad("chunk", "a chunk header, not an end header")
    return Staged(_int(body, "slot"), _int(body, "nbytes"), header)


def decode_ring(frame: bytes) -> Ring:
    """Decode's answer to an open."""
    body = _envelope(frame, ("ring",))
    slots = body.get("slots")
    if (
        not isinstance(slots, list)
        or len(slots) > MAX_RING_SLOTS
        or not all(type(s) is int and 0 <= s < _MAX_INT for s in slots)
        or len(set(slots)) != len(slots)
    ):
        raise _bad("slots", f"a list of at most {MAX_RING_SLOTS} distinct slot indices")
    slot_nbytes = _int(body, "slot_nbytes")
    if slots and slot_nbytes <= 0:
        raise _bad("slot_nbytes", "a positive size")
    return Ring(tuple(slots), slot_nbytes)


def _envelope(frame: bytes, kinds: tuple[str, ...]) -> dict:
    if len(frame) > MAX_HEADER_NBYTES:
        raise TransportError(
            f"staging frame of {len(frame)} bytes is over {MAX_HEADER_NBYTES}", code=Reason.FRAME_TOO_LARGE
        )
    try:
        body = msgpack.unpackb(
            frame,
            raw=False,
            max_bin_len=MAX_HEADER_NBYTES,
            max_str_len=4096,
            max_array_len=1 << 16,
            max_map_len=16,
        )
    except (ValueError, msgpack.UnpackException) as err:
        raise TransportError(
            f"staging frame is not msgpack ({type(err).__name__})", code=Reason.BAD_FRAME
        ) from None
    if not isinstance(body, dict):
        raise TransportError("staging frame is not a map", code=Reason.BAD_FRAME)
    if body.get("v") != WIRE_VERSION:
        raise TransportError(
            f"staging frame version {body.get('v')!r} is not {WIRE_VERSION}", code=Reason.VERSION_UNSUPPORTED
        )
    if body.get("t") not in kinds:
        raise _bad("t", f"one of {list(kinds)}")
    return body


def _int(body: dict, name: str) -> int:
    value = body.get(name)
    if type(value) is not int or not 0 <= value < _MAX_INT:
        raise _bad(name, "a non-negative integer")
    return value


def _bad(name: str, expected: str) -> TransportError:
    return TransportError(f"staging frame field {name!r}: expected {expected}", code=Reason.BAD_FRAME)
