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
``np.frombuffer`` to read. A peer's frame is untrusted: every field is checked
here (type, range, size) and a bad one raises :class:`TransportError` with
BAD_FRAME naming the field; bounds against regions are checked by
:func:`~pd_transfer.transport.copy.packing.check_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.copy.packing import WireRuns

WIRE_VERSION = 1
MAX_HEADER_NBYTES = 8 << 20
MAX_REGIONS_PER_CHUNK = 4096
MAX_ID_LEN = 256
_MAX_INT = 2**62


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
class Done:
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


def encode(message: ChunkHeader | EndHeader | Ack | Done | Fail) -> bytes:
    if isinstance(message, ChunkHeader):
        body = {
            "t": "chunk",
            "xfer": message.xfer,
            "room": message.room,
            "gen": message.generation,
            "seq": message.seq,
            "regions": list(message.wire.regions),
            "runs": np.ascontiguousarray(message.wire.runs, dtype="<i8").tobytes(),
        }
    elif isinstance(message, EndHeader):
        body = {
            "t": "end",
            "xfer": message.xfer,
            "room": message.room,
            "gen": message.generation,
            "chunks": message.num_chunks,
            "nbytes": message.nbytes,
        }
    elif isinstance(message, Ack):
        body = {"t": "ack", "xfer": message.xfer, "seq": message.seq, "nbytes": message.nbytes}
    elif isinstance(message, Done):
        body = {"t": "done", "xfer": message.xfer, "nbytes": message.nbytes}
    elif isinstance(message, Fail):
        body = {"t": "fail", "xfer": message.xfer, "code": message.code, "text": message.text[:2000]}
    else:
        raise TypeError(f"not a data-plane frame: {message!r}")
    return msgpack.packb({"v": WIRE_VERSION, **body}, use_bin_type=True)


def decode_data(frame: bytes) -> ChunkHeader | EndHeader:
    """A sender's header frame, checked field by field."""
    body = _envelope(frame, ("chunk", "end"))
    xfer, room, gen = _int(body, "xfer"), _str(body, "room"), _int(body, "gen")
    if body["t"] == "end":
        return EndHeader(xfer, room, gen, _int(body, "chunks"), _int(body, "nbytes"))
    regions = body.get("regions")
    if (
        not isinstance(regions, list)
        or len(regions) > MAX_REGIONS_PER_CHUNK
        or not all(isinstance(r, str) and 0 < len(r) <= MAX_ID_LEN for r in regions)
    ):
        raise _bad("regions", f"a list of at most {MAX_REGIONS_PER_CHUNK} region ids")
    raw = body.get("runs")
    if not isinstance(raw, bytes) or len(raw) % 24:
        raise _bad("runs", "bytes holding (n, 3) little-endian int64")
    runs = np.frombuffer(raw, dtype="<i8").reshape(-1, 3).astype(np.int64, copy=False)
    return ChunkHeader(xfer, room, gen, _int(body, "seq"), WireRuns(tuple(regions), runs))


def decode_reply(frame: bytes) -> Ack | Done | Fail:
    """A receiver's reply frame."""
    body = _envelope(frame, ("ack", "done", "fail"))
    xfer = _int(body, "xfer", low=-1)
    if body["t"] == "ack":
        return Ack(xfer, _int(body, "seq"), _int(body, "nbytes"))
    if body["t"] == "done":
        return Done(xfer, _int(body, "nbytes"))
    return Fail(xfer, _str(body, "code"), _str(body, "text", max_len=4000))


def _envelope(frame: bytes, kinds: tuple[str, ...]) -> dict[str, Any]:
    if len(frame) > MAX_HEADER_NBYTES:
        raise TransportError(
            f"data-plane header of {len(frame)} bytes exceeds {MAX_HEADER_NBYTES}",
            code=Reason.FRAME_TOO_LARGE,
        )
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types
        raise TransportError(
            f"data-plane header is not msgpack: {type(err).__name__}", code=Reason.BAD_FRAME
        ) from None
    if not isinstance(body, dict):
        raise TransportError("data-plane header is not a map", code=Reason.BAD_FRAME)
    version = body.get("v")
    if version != WIRE_VERSION:
        raise TransportError(
            f"data-plane version {version!r} is not {WIRE_VERSION}", code=Reason.VERSION_UNSUPPORTED
        )
    if body.get("t") not in kinds:
        raise TransportError(
            f"data-plane frame type {body.get('t')!r} is not one of {list(kinds)}",
            code=Reason.UNKNOWN_MESSAGE,
        )
    return body


def _int(body: dict, key: str, *, low: int = 0) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < _MAX_INT:
        raise _bad(key, f"an int in [{low}, 2**62)")
    return value


def _str(body: dict, key: str, *, max_len: int = MAX_ID_LEN) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > max_len:
        raise _bad(key, f"a string of at most {max_len} characters")
    return value


def _bad(key: str, wanted: str) -> TransportError:
    return TransportError(f"data-plane header field {key!r} must be {wanted}", code=Reason.BAD_FRAME)
