"""Frames <-> messages: the msgpack envelope, limits, and one error class.

A frame is one msgpack map::

    {"t": "abort", "v": [1, 0], "room": 42, "generation": 1,
     "reason": "aborted", "reason_text": "client cancelled request"}

``t`` is the message type tag, ``v`` the protocol version the sender speaks,
and every field travels by name (never by position, unlike SGLang's
``msg[14]``). :func:`decode` checks, in order:

1. the frame size (``frame_too_large``);
2. msgpack validity, with string, binary, list and map lengths capped while
   unpacking (``bad_frame`` / ``limit_exceeded``), then the nesting depth;
3. the envelope: a map with a str ``t`` and a ``v`` of two ints; a different
   MAJOR version is refused (``version_unsupported``), a newer MINOR accepted;
4. the type tag (``unknown_message``);
5. every field's type and range, with the field's path (``bad_field``);
   unknown fields are ignored.

Every failure raises :class:`~pd_transfer.errors.ProtocolError` with a reason
code; no msgpack, Key, Type or Value error escapes.

Pure (sans-IO): bytes in, objects out. Imports msgpack, nothing with sockets.
"""

from __future__ import annotations

from typing import Any

import msgpack

from pd_transfer.errors import LocalProtocolError, ProtocolError, Reason
from pd_transfer.protocol.fields import Int, Str, TupleOf, bad_field, type_name
from pd_transfer.protocol.limits import DEFAULT_LIMITS, Limits, check_depth
from pd_transfer.protocol.messages import PROTOCOL_VERSION, Message
from pd_transfer.protocol.schema import RECORDS, RECORDS_BY_TAG

_TAG = Str(max_len=64, min_len=1)
_VERSION = TupleOf((Int(hi=65535), Int(hi=65535)))


def encode(message: Message) -> bytes:
    """The frame of ``message``. Raises LocalProtocolError for a non-message."""
    record = RECORDS.get(type(message))
    if record is None:
        raise LocalProtocolError(
            f"cannot encode {type(message).__name__}: not a protocol message", code=Reason.UNKNOWN_MESSAGE
        )
    frame = {"t": message.TAG, "v": list(PROTOCOL_VERSION)}
    frame.update(record.encode(message))
    return msgpack.packb(frame, use_bin_type=True)


def decode(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The message in ``frame``, fully checked; see the module docstring."""
    raw = _unpack(frame, limits)
    tag = _envelope(raw)
    _, record = RECORDS_BY_TAG[tag]
    return record.decode(raw, f"$.{tag}")


def _unpack(frame: Any, limits: Limits) -> Any:
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(
            f"expected a bytes frame, got {type(frame).__name__}", code=Reason.BAD_FRAME, path="$"
        )
    if len(frame) > limits.max_frame_nbytes:
        raise ProtocolError(
            f"frame of {len(frame)} bytes exceeds the limit of {limits.max_frame_nbytes} bytes",
            code=Reason.FRAME_TOO_LARGE,
            path="$",
        )
    try:
        raw = msgpack.unpackb(frame, **limits.unpack_options())
    except msgpack.StackError:
        raise ProtocolError(
            "frame nests deeper than msgpack can unpack", code=Reason.LIMIT_EXCEEDED, path="$"
        ) from None
    # Third-party errors are translated here, at the edge: msgpack signals
    # malformed input with ValueError (and subclasses: ExtraData, FormatError,
    # UnicodeDecodeError), OutOfData, or TypeError for odd keys.
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        detail = str(exc) or type(exc).__name__
        if "exceeds max_" in detail:
            raise ProtocolError(
                f"frame exceeds a decoding limit: {detail}", code=Reason.LIMIT_EXCEEDED, path="$"
            ) from None
        raise ProtocolError(f"not a valid msgpack frame: {detail}", code=Reason.BAD_FRAME, path="$") from None
    check_depth(raw, limits.max_depth)
    return raw


def _envelope(raw: Any) -> str:
    """Check the envelope of an unpacked frame; return its type tag."""
    if not isinstance(raw, dict):
        raise ProtocolError(
            f'expected a map with a type tag "t", got {type_name(raw)}', code=Reason.BAD_FRAME, path="$"
        )
    if "t" not in raw:
        raise ProtocolError("missing message type tag", code=Reason.BAD_FRAME, path="$.t")
    if "v" not in raw:
        raise ProtocolError("missing protocol version", code=Reason.BAD_FRAME, path="$.v")
    tag = _TAG.decode(raw["t"], "$.t")
    major, minor = _VERSION.decode(raw["v"], "$.v")
    ours = PROTOCOL_VERSION
    if major != ours[0]:
        raise ProtocolError(
            f"peer speaks protocol {major}.{minor}, this agent speaks "
            f"{ours[0]}.{ours[1]}; major versions must match",
            code=Reason.VERSION_UNSUPPORTED,
            path="$.v",
        )
    if tag not in RECORDS_BY_TAG:
        known = ", ".join(RECORDS_BY_TAG)
        raise bad_field(
            "$.t",
            f"unknown message type {tag!r}; protocol {ours[0]}.{ours[1]} knows {known}",
            code=Reason.UNKNOWN_MESSAGE,
        )
    return tag
