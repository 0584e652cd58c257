"""The one envelope: a msgpack map with a type tag ``t`` and a version ``v``.

Every framing writes its messages as one msgpack map, fields by name::

    {"t": "abort", "v": [1, 0], "room": 42, ...}     protocol and handshake: v = [major, minor]
    {"v": 1, "t": "chunk", "xfer": 7, ...}            tcp data plane and staging: v = one int

:func:`unpack` checks, in order: the frame size (``frame_too_large``), msgpack
validity with string, binary, list and map lengths capped while unpacking
(``bad_frame`` / ``limit_exceeded``), then the nesting depth. An
:class:`Envelope` then checks the header: a map, a str tag, the version (a
different major, or a different int version, is ``version_unsupported``; a
newer minor is accepted) and a tag it knows (``unknown_message``). Every
failure raises :class:`~pd_transfer.errors.ProtocolError` with a reason code
and the path of what is wrong; no msgpack, Key, Type or Value error escapes.
A framing whose callers expect another error class translates it once, with
:func:`translated`.

Pure (sans-IO): imports msgpack, the standard library and ``pd_transfer.errors``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgpack

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.wire.fields import Int, Str, TupleOf, bad_field, type_name
from pd_transfer.wire.limits import MAX_TAG_LEN, Limits, check_depth

TAG = Str(max_len=MAX_TAG_LEN, min_len=1)
VERSION = TupleOf((Int(hi=65535), Int(hi=65535)))


def pack(data: Any) -> bytes:
    """The msgpack bytes of plain data (bytes as bin, str as str; map key order kept)."""
    packed: bytes = msgpack.packb(data, use_bin_type=True)
    return packed


def unpack(frame: Any, limits: Limits, what: str = "frame") -> Any:
    """The plain data in ``frame``, unpacked under ``limits``; ``what`` names it in errors."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(
            f"expected a bytes frame, got {type(frame).__name__}", code=Reason.BAD_FRAME, path="$"
        )
    if len(frame) > limits.max_frame_nbytes:
        raise ProtocolError(
            f"{what} of {len(frame)} bytes exceeds the limit of {limits.max_frame_nbytes} bytes",
            code=Reason.FRAME_TOO_LARGE,
            path="$",
        )
    try:
        raw = msgpack.unpackb(frame, **limits.unpack_options())
    except msgpack.StackError:
        raise ProtocolError(
            f"{what} nests deeper than msgpack can unpack", code=Reason.LIMIT_EXCEEDED, path="$"
        ) from None
    # Third-party errors are translated here, at the edge: msgpack signals
    # malformed input with ValueError (and subclasses: ExtraData, FormatError,
    # UnicodeDecodeError), OutOfData, or TypeError for odd keys.
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        detail = str(exc) or type(exc).__name__
        if "exceeds max_" in detail:
            raise ProtocolError(
                f"{what} exceeds a decoding limit: {detail}", code=Reason.LIMIT_EXCEEDED, path="$"
            ) from None
        raise ProtocolError(
            f"not a valid msgpack {what}: {detail}", code=Reason.BAD_FRAME, path="$"
        ) from None
    check_depth(raw, limits.max_depth)
    return raw


@dataclass(frozen=True)
class Envelope:
    """One framing's header: its version, its unpacking caps, and what its tags are called.

    ``version`` is ``(major, minor)`` (written first ``t`` then ``v``, as a
    list) or one int (written ``v`` first); each framing keeps the key order
    it always had, so its bytes do not change.
    """

    version: tuple[int, int] | int
    limits: Limits
    what: str = "frame"  # names the frame in size and msgpack errors
    tag_noun: str = "message type"  # names the tag in unknown-tag errors

    def pack(self, tag: str, fields: dict[str, Any]) -> bytes:
        if isinstance(self.version, tuple):
            return pack({"t": tag, "v": list(self.version), **fields})
        return pack({"v": self.version, "t": tag, **fields})

    def open(self, frame: Any, tags: Collection[str]) -> tuple[str, dict[str, Any]]:
        """The tag and the map of a frame whose header is checked; ``tags`` are those accepted."""
        raw = unpack(frame, self.limits, self.what)
        if isinstance(self.version, tuple):
            return self._versioned(raw, self.version, tags), raw
        return self._numbered(raw, self.version, tags), raw

    def _versioned(self, raw: Any, ours: tuple[int, int], tags: Collection[str]) -> str:
        if not isinstance(raw, dict):
            raise ProtocolError(
                f'expected a map with a type tag "t", got {type_name(raw)}', code=Reason.BAD_FRAME, path="$"
            )
        if "t" not in raw:
            raise ProtocolError("missing message type tag", code=Reason.BAD_FRAME, path="$.t")
        if "v" not in raw:
            raise ProtocolError("missing protocol version", code=Reason.BAD_FRAME, path="$.v")
        tag = TAG.decode(raw["t"], "$.t")
        major, minor = VERSION.decode(raw["v"], "$.v")
        if major != ours[0]:
            raise ProtocolError(
                f"peer speaks protocol {major}.{minor}, this agent speaks "
                f"{ours[0]}.{ours[1]}; major versions must match",
                code=Reason.VERSION_UNSUPPORTED,
                path="$.v",
            )
        if tag not in tags:
            raise bad_field(
                "$.t",
                f"unknown {self.tag_noun} {tag!r}; protocol {ours[0]}.{ours[1]} knows {', '.join(tags)}",
                code=Reason.UNKNOWN_MESSAGE,
            )
        return tag

    def _numbered(self, raw: Any, ours: int, tags: Collection[str]) -> str:
        if not isinstance(raw, dict):
            raise ProtocolError(f"expected a map, got {type_name(raw)}", code=Reason.BAD_FRAME, path="$")
        version = raw.get("v")
        if version != ours:
            raise ProtocolError(
                f"version {_shown(version)} is not {ours}", code=Reason.VERSION_UNSUPPORTED, path="$.v"
            )
        tag = raw.get("t")
        if not isinstance(tag, str) or tag not in tags:
            raise ProtocolError(
                f"{self.tag_noun} {_shown(tag)} is not one of {list(tags)}",
                code=Reason.UNKNOWN_MESSAGE,
                path="$.t",
            )
        return tag


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(value[:64])
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return type_name(value)


def translated(
    error: ProtocolError, cls: type[PdTransferError], what: str, kept: Collection[Reason]
) -> PdTransferError:
    """``error`` as a ``cls`` for a framing whose callers catch ``cls``: the text
    keeps the path and says which framing (``what``); a code outside ``kept``
    becomes ``bad_frame``."""
    return cls(f"{what}: {error.message}", code=error.code if error.code in kept else Reason.BAD_FRAME)
