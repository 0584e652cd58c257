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

A peer's frame is untrusted: the envelope and every field are checked with
:mod:`pd_transfer.wire` (caps from :mod:`pd_transfer.wire.limits`) and a bad
one raises :class:`TransportError` with BAD_FRAME naming the field path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_transfer.errors import ProtocolError, Reason, TransportError
from pd_transfer.transport.tcp.frames import ChunkHeader, decode_data
from pd_transfer.transport.tcp.frames import encode as encode_chunk
from pd_transfer.wire.envelope import Envelope, translated
from pd_transfer.wire.fields import Field, Int, ListOf, Record, bad_field
from pd_transfer.wire.limits import DATA_PLANE_HEADER_NBYTES, DATA_PLANE_LIMITS, MAX_RING_SLOTS
from pd_transfer.wire.packed import Bytes

WIRE_VERSION = 1
MAX_HEADER_NBYTES = DATA_PLANE_HEADER_NBYTES
ENVELOPE = Envelope(WIRE_VERSION, DATA_PLANE_LIMITS, tag_noun="staging frame type")
#: envelope codes a staging error keeps; any other (an unknown type too) becomes bad_frame
KEPT_CODES = frozenset({Reason.FRAME_TOO_LARGE, Reason.VERSION_UNSUPPORTED})
_COUNT = Int(hi=2**62 - 1)


def _distinct_slots(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    if len(set(values["slots"])) != len(values["slots"]):
        raise bad_field(f"{path}.slots", "expected distinct slot indices")
    if values["slots"] and values["slot_nbytes"] <= 0:
        raise bad_field(f"{path}.slot_nbytes", "expected a positive size")


_RECORDS = {
    "open": Record(dict, (Field("slots", Int(lo=1, hi=MAX_RING_SLOTS)),)),
    "staged": Record(
        dict,
        (
            Field("chunk", Bytes(max_len=DATA_PLANE_HEADER_NBYTES)),
            Field("slot", _COUNT),
            Field("nbytes", _COUNT),
        ),
    ),
    "ring": Record(
        dict,
        (Field("slots", ListOf(_COUNT, MAX_RING_SLOTS)), Field("slot_nbytes", _COUNT)),
        finish=_distinct_slots,
    ),
}


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
    body: dict[str, Any]
    if isinstance(message, OpenRing):
        tag, body = "open", {"slots": message.slots}
    elif isinstance(message, Ring):
        tag, body = "ring", {"slots": list(message.slots), "slot_nbytes": message.slot_nbytes}
    elif isinstance(message, Staged):
        tag, body = (
            "staged",
            {"slot": message.slot, "nbytes": message.nbytes, "chunk": encode_chunk(message.chunk)},
        )
    else:
        raise TypeError(f"not a staging frame: {message!r}")
    return ENVELOPE.pack(tag, body)


def decode_request(frame: bytes) -> OpenRing | Staged:
    """A prefill side's request, checked field by field."""
    tag, f = _decoded(frame, ("open", "staged"))
    if tag == "open":
        return OpenRing(f["slots"])
    header = decode_data(f["chunk"])
    if not isinstance(header, ChunkHeader):
        raise TransportError(
            "staging frame: at $.staged.chunk: expected a chunk header, not an end header",
            code=Reason.BAD_FRAME,
        )
    return Staged(f["slot"], f["nbytes"], header)


def decode_ring(frame: bytes) -> Ring:
    """Decode's answer to an open."""
    _, f = _decoded(frame, ("ring",))
    return Ring(f["slots"], f["slot_nbytes"])


def _decoded(frame: bytes, tags: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The tag and checked fields of a staging frame; TransportError naming the field."""
    try:
        tag, raw = ENVELOPE.open(frame, tags)
        return tag, _RECORDS[tag].decode(raw, f"$.{tag}")
    except ProtocolError as err:
        raise translated(err, TransportError, "staging frame", KEPT_CODES) from None
