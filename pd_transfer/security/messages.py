"""The four handshake messages and their strict codec.

Framed like every protocol message: one msgpack map with the type tag ``t``,
the protocol version ``v`` and named fields::

    {"t": "auth_hello", "v": [1, 0], "agent_id": "decode-0", "nonce": <32 bytes>}

    connecting side                       listening side
    AuthHello(agent_id, nonce)      ->
                                    <-    AuthChallenge(agent_id, nonce, proof)
    AuthProof(nonce, proof)         ->
                                    <-    AuthResult(accepted, reason, reason_text)

The handshake frames are tiny, so the limits are tighter than the
protocol's: 2 KiB a frame, 16 map entries, 1 KiB strings, depth 2. Every
failure is a :class:`~pd_transfer.errors.ProtocolError` with a reason code;
a frame of another type (``hello``, a worker request) is ``unknown_message``.

Pure; imports msgpack and the protocol layer's field kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from pd_transfer.errors import ProtocolError, Reason
from pd_transfer.protocol.fields import (
    Bool,
    Field,
    Int,
    Kind,
    Optional,
    ReasonCode,
    Record,
    Str,
    TupleOf,
    bad_field,
    type_name,
)
from pd_transfer.protocol.limits import Limits, check_depth
from pd_transfer.protocol.messages import PROTOCOL_VERSION, clip_text

NONCE_NBYTES = 32
PROOF_NBYTES = 32  # HMAC-SHA256
MAX_AUTH_TEXT_LEN = 1024

AUTH_LIMITS = Limits(max_frame_nbytes=2048, max_list_len=16, max_map_len=16, max_str_len=1024, max_depth=2)


@dataclass(frozen=True)
class Blob(Kind):
    """Exactly ``nbytes`` bytes (a nonce, an HMAC)."""

    nbytes: int

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"{self.nbytes} bytes"

    def decode(self, raw: Any, path: str) -> bytes:
        if not isinstance(raw, bytes):
            raise self.expected(raw, path)
        if len(raw) != self.nbytes:
            raise bad_field(path, f"expected {self.nbytes} bytes, got {len(raw)}")
        return raw


class AuthMessage:
    TAG: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class AuthHello(AuthMessage):
    """Connecting side: who I am, and a fresh nonce the listener must prove with."""

    TAG: ClassVar[str] = "auth_hello"
    agent_id: str
    nonce: bytes


@dataclass(frozen=True, kw_only=True)
class AuthChallenge(AuthMessage):
    """Listening side: its nonce (single use) and its proof over both nonces."""

    TAG: ClassVar[str] = "auth_challenge"
    agent_id: str
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, kw_only=True)
class AuthProof(AuthMessage):
    """Connecting side: its proof, and which challenge (``nonce``) it answers."""

    TAG: ClassVar[str] = "auth_proof"
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, kw_only=True)
class AuthResult(AuthMessage):
    """Either side: accepted, or refused with a reason code and text."""

    TAG: ClassVar[str] = "auth_result"
    accepted: bool
    reason: Reason | None = None
    reason_text: str = ""


_ID = Str(max_len=256, min_len=1)
_NONCE = Blob(NONCE_NBYTES)
_PROOF = Blob(PROOF_NBYTES)


def _check_result(values: dict[str, Any], raw: dict[str, Any], path: str) -> None:
    if values["accepted"] == (values["reason"] is not None):
        raise bad_field(f"{path}.reason", "a refusal carries a reason code, an acceptance none")


AUTH_RECORDS: dict[str, Record] = {
    AuthHello.TAG: Record(AuthHello, (Field("agent_id", _ID), Field("nonce", _NONCE))),
    AuthChallenge.TAG: Record(
        AuthChallenge, (Field("agent_id", _ID), Field("nonce", _NONCE), Field("proof", _PROOF))
    ),
    AuthProof.TAG: Record(AuthProof, (Field("nonce", _NONCE), Field("proof", _PROOF))),
    AuthResult.TAG: Record(
        AuthResult,
        (
            Field("accepted", Bool()),
            Field("reason", Optional(ReasonCode()), default=None),
            Field("reason_text", Str(max_len=MAX_AUTH_TEXT_LEN), default=""),
        ),
        finish=_check_result,
    ),
}

_TAG = Str(max_len=64, min_len=1)
_VERSION = TupleOf((Int(hi=65535), Int(hi=65535)))


def encode(message: AuthMessage) -> bytes:
    if isinstance(message, AuthResult):
        message = AuthResult(
            accepted=message.accepted,
            reason=message.reason,
            reason_text=clip_text(message.reason_text, MAX_AUTH_TEXT_LEN),
        )
    frame = {"t": message.TAG, "v": list(PROTOCOL_VERSION)}
    frame.update(AUTH_RECORDS[message.TAG].encode(message))
    return msgpack.packb(frame, use_bin_type=True)


def decode(frame: bytes | bytearray | memoryview) -> AuthMessage:
    """The handshake message in ``frame``; ProtocolError (with a code) otherwise."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected a bytes frame, got {type(frame).__name__}", path="$")
    if len(frame) > AUTH_LIMITS.max_frame_nbytes:
        raise ProtocolError(
            f"a handshake frame of {len(frame)} bytes exceeds the limit of "
            f"{AUTH_LIMITS.max_frame_nbytes} bytes",
            code=Reason.FRAME_TOO_LARGE,
            path="$",
        )
    try:
        raw = msgpack.unpackb(frame, **AUTH_LIMITS.unpack_options())
    # msgpack signals bad input with several unrelated types; translated here, at the edge
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        raise ProtocolError(
            f"not a valid msgpack frame: {str(exc) or type(exc).__name__}", path="$"
        ) from None
    check_depth(raw, AUTH_LIMITS.max_depth)
    if not isinstance(raw, dict) or "t" not in raw or "v" not in raw:
        raise ProtocolError(f'expected a map with "t" and "v", got {type_name(raw)}', path="$")
    tag = _TAG.decode(raw["t"], "$.t")
    major, minor = _VERSION.decode(raw["v"], "$.v")
    if major != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            f"peer speaks protocol {major}.{minor}, this agent speaks "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}",
            code=Reason.VERSION_UNSUPPORTED,
            path="$.v",
        )
    record = AUTH_RECORDS.get(tag)
    if record is None:
        raise bad_field("$.t", f"{tag[:64]!r} is not a handshake message", code=Reason.UNKNOWN_MESSAGE)
    return record.decode(raw, f"$.{tag}")
