"""The tcp data plane's frames: a msgpack header, then (for a chunk) the payload.

Sans-IO: encoding and strict decoding only. Sender -> receiver::

    [chunk header, payload]   {"v": 1, "t": "chunk", "xfer", "room", "gen", "seq",
                               "regions": [dst region ids], "runs": <int64 LE (n, 3)>}
    [end header]              {"v": 1, "t": "end", "xfer", "room", "gen", "chunks", "nbytes"}

Receiver -> sender::

    {"v": 1, "t": "ack",  "xfer", "seq", "nbytes"}   a chunk landed: frees window credit
    {"v": 1, "t": "done", "xfer", "nbytes"}          every chunk of the transfer landed
    {"v": 1, "t": "fail", "xfer", "code", "text"}    the transfer is refused; code is a Reason

``runs`` rows are ``(region slot, offset, nbytes)``: packed int64 rather than
a msgpack list, so a 4 MiB chunk of 8 KiB runs costs 12 KiB of header and one
``np.frombuffer`` to read. A peer's frame is untrusted: the envelope and every field are checked with
:mod:`pd_transfer.wire` (type, range, size; caps from
:mod:`pd_transfer.wire.limits`) and a bad one raises :class:`TransportError`
with BAD_FRAME naming the field path (``at $.chunk.regions[3]``); bounds against regions are checked by
:func:`~pd_transfer.transport.copy.packing.check_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pd_transfer.errors import ProtocolError, Reason, TransportError
from pd_transfer.transport.copy.packing import WireRuns
from pd_transfer.wire.envelope import Envelope, translated
from pd_transfer.wire.fields import Field, Int, ListOf, Record, Str
from pd_transfer.wire.limits import (
    DATA_PLANE_HEADER_NBYTES,
    DATA_PLANE_LIMITS,
    FAIL_TEXT_SENT_LEN,
    MAX_FAIL_TEXT_LEN,
    MAX_ID_LEN,
    MAX_REGIONS_PER_CHUNK,
)
from pd_transfer.wire.packed import Bytes

WIRE_VERSION = 1
MAX_HEADER_NBYTES = DATA_PLANE_HEADER_NBYTES
ENVELOPE = Envelope(WIRE_VERSION, DATA_PLANE_LIMITS, tag_noun="data-plane frame type")
#: envelope codes a data-plane error keeps; any other becomes bad_frame
KEPT_CODES = frozenset({Reason.FRAME_TOO_LARGE, Reason.VERSION_UNSUPPORTED, Reason.UNKNOWN_MESSAGE})
_MAX_INT = 2**62 - 1
_COUNT = Int(hi=_MAX_INT)
_ID = Str(max_len=MAX_ID_LEN)


@dataclass(frozen=True)
class ChunkHeader:
    xfer: int
    room: str
    generation: int
    seq: int
    wire: WireRuns


@dataclass(frozen=True)
class EndHeader:
    xfer: int
    room: str
    generation: int
    num_chunks: int
    nbytes: int


@dataclass(frozen=True)
class Ack:
    xfer: int
    seq: int
    nbytes: int


@dataclass(frozen=True)
class XferDone:
    xfer: int
    nbytes: int


@dataclass(frozen=True)
class Fail:
    xfer: int
    code: str
    text: str

    def reason(self) -> Reason:
        try:
            return Reason(self.code)
        except ValueError:
            return Reason.UNRECOGNIZED_REASON


_RECORDS = {
    "chunk": Record(
        dict,
        (
            Field("xfer", _COUNT),
            Field("room", _ID),
            Field("gen", _COUNT),
            Field("seq", _COUNT),
            Field("regions", ListOf(Str(max_len=MAX_ID_LEN, min_len=1), MAX_REGIONS_PER_CHUNK)),
            Field("runs", Bytes(max_len=DATA_PLANE_HEADER_NBYTES, multiple_of=24)),
        ),
    ),
    "end": Record(
        dict,
        (
            Field("xfer", _COUNT),
            Field("room", _ID),
            Field("gen", _COUNT),
            Field("chunks", _COUNT),
            Field("nbytes", _COUNT),
        ),
    ),
    "ack": Record(
        dict, (Field("xfer", Int(lo=-1, hi=_MAX_INT)), Field("seq", _COUNT), Field("nbytes", _COUNT))
    ),
    "done": Record(dict, (Field("xfer", Int(lo=-1, hi=_MAX_INT)), Field("nbytes", _COUNT))),
    "fail": Record(
        dict,
        (
            Field("xfer", Int(lo=-1, hi=_MAX_INT)),
            Field("code", _ID),
            Field("text", Str(max_len=MAX_FAIL_TEXT_LEN)),
        ),
    ),
}


def encode(message: ChunkHeader | EndHeader | Ack | XferDone | Fail) -> bytes:
    if isinstance(message, ChunkHeader):
        tag, body = (
            "chunk",
            {
                "xfer": message.xfer,
                "room": message.room,
                "gen": message.generation,
                "seq": message.seq,
                "regions": list(message.wire.regions),
                "runs": np.ascontiguousarray(message.wire.runs, dtype="<i8").tobytes(),
            },
        )
    elif isinstance(message, EndHeader):
        tag, body = (
            "end",
            {
                "xfer": message.xfer,
                "room": message.room,
                "gen": message.generation,
                "chunks": message.num_chunks,
                "nbytes": message.nbytes,
            },
        )
    elif isinstance(message, Ack):
        tag, body = "ack", {"xfer": message.xfer, "seq": message.seq, "nbytes": message.nbytes}
    elif isinstance(message, XferDone):
        tag, body = "done", {"xfer": message.xfer, "nbytes": message.nbytes}
    elif isinstance(message, Fail):
        tag, body = (
            "fail",
            {"xfer": message.xfer, "code": message.code, "text": message.text[:FAIL_TEXT_SENT_LEN]},
        )
    else:
        raise TypeError(f"not a data-plane frame: {message!r}")
    return ENVELOPE.pack(tag, body)


def decode_data(frame: bytes) -> ChunkHeader | EndHeader:
    """A sender's header frame, checked field by field."""
    tag, f = _decoded(frame, ("chunk", "end"))
    if tag == "end":
        return EndHeader(f["xfer"], f["room"], f["gen"], f["chunks"], f["nbytes"])
    runs = np.frombuffer(f["runs"], dtype="<i8").reshape(-1, 3).astype(np.int64, copy=False)
    return ChunkHeader(f["xfer"], f["room"], f["gen"], f["seq"], WireRuns(f["regions"], runs))


def decode_reply(frame: bytes) -> Ack | XferDone | Fail:
    """A receiver's reply frame."""
    tag, f = _decoded(frame, ("ack", "done", "fail"))
    if tag == "ack":
        return Ack(f["xfer"], f["seq"], f["nbytes"])
    if tag == "done":
        return XferDone(f["xfer"], f["nbytes"])
    return Fail(f["xfer"], f["code"], f["text"])


def _decoded(frame: bytes, tags: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """The tag and checked fields of a data-plane frame; TransportError naming the field."""
    try:
        tag, raw = ENVELOPE.open(frame, tags)
        return tag, _RECORDS[tag].decode(raw, f"$.{tag}")
    except ProtocolError as err:
        raise translated(err, TransportError, "data-plane header", KEPT_CODES) from None
