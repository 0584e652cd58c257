"""The four handshake messages and their strict codec.

Framed like every protocol message: one msgpack map with the type tag ``t``,
the protocol version ``v`` and named fields::

    {"t": "auth_hello", "v": [1, 0], "agent_id": "decode-0", "nonce": <32 bytes>}

    connecting side                       listening side
    AuthHello(agent_id, nonce)      ->
                                    <-    AuthChallenge(agent_id, nonce, proof)
    AuthProof(nonce, proof)         ->
                                    <-    AuthResult(accepted, reason, reason_text)

The handshake frames are tiny, so their limits
(:data:`~pd_transfer.wire.limits.HANDSHAKE_LIMITS`) are tighter than the
protocol's: 2 KiB a frame, 16 map entries, 1 KiB strings, depth 2. Every
failure is a :class:`~pd_transfer.errors.ProtocolError` with a reason code;
a frame of another type (``hello``, a worker request) is ``unknown_message``.

Pure; imports the wire layer's envelope and field kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pd_transfer.errors import Reason
from pd_transfer.protocol.messages import PROTOCOL_VERSION
from pd_transfer.wire.envelope import Envelope
from pd_transfer.wire.fields import Bool, Field, Optional, ReasonCode, Record, Str, bad_field, clip_text
from pd_transfer.wire.limits import HANDSHAKE_LIMITS, MAX_HANDSHAKE_TEXT_LEN, MAX_ID_LEN
from pd_transfer.wire.packed import Blob

NONCE_NBYTES = 32
PROOF_NBYTES = 32  # HMAC-SHA256

_ENVELOPE = Envelope(PROTOCOL_VERSION, HANDSHAKE_LIMITS, what="handshake frame", tag_noun="handshake message")


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


_ID = Str(max_len=MAX_ID_LEN, min_len=1)
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
            Field("reason_text", Str(max_len=MAX_HANDSHAKE_TEXT_LEN), default=""),
        ),
        finish=_check_result,
    ),
}


def encode(message: AuthMessage) -> bytes:
    if isinstance(message, AuthResult):
        message = AuthResult(
            accepted=message.accepted,
            reason=message.reason,
            reason_text=clip_text(message.reason_text, MAX_HANDSHAKE_TEXT_LEN),
        )
    return _ENVELOPE.pack(message.TAG, AUTH_RECORDS[message.TAG].encode(message))


def decode(frame: bytes | bytearray | memoryview) -> AuthMessage:
    """The handshake message in ``frame``; ProtocolError (with a code) otherwise."""
    tag, raw = _ENVELOPE.open(frame, AUTH_RECORDS)
    return AUTH_RECORDS[tag].decode(raw, f"$.{tag}")
