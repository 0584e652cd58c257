"""The mutual, replay-proof handshake, sans-IO: frames in, frames out.

Both sides hold the shared secret; neither ever sends it. The key is
``HMAC-SHA256(secret, "pd-transfer auth key v1")``; each proof is an
HMAC-SHA256 under it over a transcript::

    server_proof = HMAC(key, "pdt-server" || client_nonce || server_nonce || ids)
    client_proof = HMAC(key, "pdt-client" || server_nonce || client_nonce || ids)
    ids          = len16(client agent id) || client agent id || len16(server id) || server id

The labels keep a proof from being reflected to the other role. The listener
proves first (mutual: a decode learns it reached a sidecar holding the
secret, not an impostor) with a fresh 32-byte nonce per connection; the
connecting side's proof covers that nonce, and the nonce is spent when the
proof is checked, right or wrong. A captured AuthProof replayed on a new
connection therefore answers a nonce that is not the connection's own and is
refused; the :class:`NonceBook` remembers recently spent nonces so such a
replay is reported as ``auth_replayed``, and recently seen client nonces so a
replayed AuthHello is refused at once. Proofs are compared with
:func:`hmac.compare_digest`.

Every failure raises :class:`~pd_transfer.errors.AuthError` whose ``reply``
is the AuthResult frame to send back; malformed frames raise
:class:`~pd_transfer.errors.ProtocolError`. Nothing else escapes.

Pure: no sockets, no clocks; nonces come from ``os.urandom`` unless given.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from collections import OrderedDict

from pd_transfer.errors import AuthError, ProtocolError, Reason
from pd_transfer.protocol import Close
from pd_transfer.protocol import decode as protocol_decode
from pd_transfer.security.messages import (
    NONCE_NBYTES,
    AuthChallenge,
    AuthHello,
    AuthMessage,
    AuthProof,
    AuthResult,
    decode,
    encode,
)
from pd_transfer.security.secret import SharedSecret

_KEY_LABEL = b"pd-transfer auth key v1"
_SERVER_LABEL = b"pdt-server"
_CLIENT_LABEL = b"pdt-client"

WRONG_KEY_HINT = (
    "give both sides the same secret (secret_file, PD_TRANSFER_SECRET_FILE or PD_TRANSFER_SECRET)"
)


def derive_key(secret: SharedSecret) -> bytes:
    return hmac.new(secret.value, _KEY_LABEL, hashlib.sha256).digest()


def _ids(client_id: str, server_id: str) -> bytes:
    parts = [client_id.encode(), server_id.encode()]
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def server_proof(
    key: bytes, client_nonce: bytes, server_nonce: bytes, client_id: str, server_id: str
) -> bytes:
    text = _SERVER_LABEL + client_nonce + server_nonce + _ids(client_id, server_id)
    return hmac.new(key, text, hashlib.sha256).digest()


def client_proof(
    key: bytes, client_nonce: bytes, server_nonce: bytes, client_id: str, server_id: str
) -> bytes:
    text = _CLIENT_LABEL + server_nonce + client_nonce + _ids(client_id, server_id)
    return hmac.new(key, text, hashlib.sha256).digest()


def refusal(code: Reason, text: str, hint: str = "") -> AuthError:
    """An AuthError whose reply tells the peer why (``text`` only, never key material)."""
    reply = encode(AuthResult(accepted=False, reason=code, reason_text=text))
    return AuthError(text, code=code, hint=hint, reply=reply)


class NonceBook:
    """Recently seen client nonces and spent server nonces, at most ``capacity`` each.

    Only the reason a replay is reported with depends on it: a replayed proof
    is refused anyway, because each connection gets its own fresh nonce.
    """

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._clients: OrderedDict[bytes, None] = OrderedDict()
        self._spent: OrderedDict[bytes, None] = OrderedDict()

    def see_client(self, nonce: bytes) -> bool:
        """Record a client nonce; False if it was seen before (a replayed hello)."""
        return self._add(self._clients, nonce)

    def spend(self, nonce: bytes) -> None:
        self._add(self._spent, nonce)

    def spent(self, nonce: bytes) -> bool:
        return nonce in self._spent

    def _add(self, book: OrderedDict[bytes, None], nonce: bytes) -> bool:
        if nonce in book:
            return False
        book[nonce] = None
        if len(book) > self.capacity:
            book.popitem(last=False)
        return True


class ServerHandshake:
    """One connection's handshake on the listening side, started by its AuthHello."""

    def __init__(
        self, key: bytes, agent_id: str, hello: AuthHello, nonces: NonceBook, *, nonce: bytes | None = None
    ) -> None:
        if not nonces.see_client(hello.nonce):
            raise refusal(
                Reason.AUTH_REPLAYED, f"{hello.agent_id}: this hello was seen before (a replayed handshake)"
            )
        self._key, self._nonces = key, nonces
        self.agent_id = agent_id
        self.peer_agent_id = hello.agent_id
        self.client_nonce = hello.nonce
        self.server_nonce = os.urandom(NONCE_NBYTES) if nonce is None else nonce

    def challenge(self) -> bytes:
        proof = server_proof(
            self._key, self.client_nonce, self.server_nonce, self.peer_agent_id, self.agent_id
        )
        return encode(AuthChallenge(agent_id=self.agent_id, nonce=self.server_nonce, proof=proof))

    def verify(self, proof: AuthProof) -> bytes:
        """The acceptance frame if ``proof`` is right; AuthError otherwise. Spends the nonce."""
        if proof.nonce != self.server_nonce:
            replayed = self._nonces.spent(proof.nonce)
            self._nonces.spend(self.server_nonce)
            if replayed:
                raise refusal(
                    Reason.AUTH_REPLAYED,
                    f"{self.peer_agent_id}: the proof answers a "
                    f"challenge already used (a replayed handshake)",
                )
            raise refusal(
                Reason.AUTH_FAILED,
                f"{self.peer_agent_id}: the proof answers a challenge this connection was not given",
            )
        self._nonces.spend(self.server_nonce)
        expected = client_proof(
            self._key, self.client_nonce, self.server_nonce, self.peer_agent_id, self.agent_id
        )
        if not hmac.compare_digest(expected, proof.proof):
            raise refusal(
                Reason.AUTH_FAILED,
                f"{self.peer_agent_id}: the proof does not verify: the two sides hold different secrets",
                hint=WRONG_KEY_HINT,
            )
        return encode(AuthResult(accepted=True))


class ClientState(enum.Enum):
    CHALLENGE = "awaiting_challenge"
    RESULT = "awaiting_result"
    DONE = "done"
    FAILED = "failed"


class ClientHandshake:
    """The connecting side: :meth:`hello`, then :meth:`receive` each answer until ``done``."""

    def __init__(
        self, secret: SharedSecret, agent_id: str, *, nonce: bytes | None = None, peer: str = "the peer"
    ) -> None:
        self._key = derive_key(secret)
        self.agent_id = agent_id
        self.peer = peer  # for messages: "bootstrap tcp://10.0.0.1:8998"
        self.peer_agent_id = ""
        self.client_nonce = os.urandom(NONCE_NBYTES) if nonce is None else nonce
        self.state = ClientState.CHALLENGE

    @property
    def done(self) -> bool:
        return self.state is ClientState.DONE

    def hello(self) -> bytes:
        return encode(AuthHello(agent_id=self.agent_id, nonce=self.client_nonce))

    def receive(self, frame: bytes) -> bytes | None:
        """The frame to send next (the proof), or None; AuthError when the handshake fails."""
        if self.state in (ClientState.DONE, ClientState.FAILED):
            raise AuthError(f"{self.peer}: a handshake frame after the handshake ended")
        try:
            message = self._decode(frame)
            if self.state is ClientState.CHALLENGE:
                return self._on_challenge(message)
            self._on_result(message)
            return None
        except AuthError:
            self.state = ClientState.FAILED
            raise

    def _decode(self, frame: bytes) -> AuthMessage:
        try:
            message = decode(frame)
        except ProtocolError as err:
            raise AuthError(
                f"{self.peer} answered the handshake with {_describe(frame, err)}; "
                f"is authentication on at both ends?",
                code=Reason.AUTH_FAILED,
            ) from None
        if isinstance(message, AuthResult) and not message.accepted:
            text = message.reason_text or "no reason given"
            raise AuthError(
                f"{self.peer} refused this agent's authentication: {text}",
                code=message.reason or Reason.AUTH_FAILED,
                hint=WRONG_KEY_HINT,
            )
        return message

    def _on_challenge(self, message: AuthMessage) -> bytes:
        if not isinstance(message, AuthChallenge):
            raise refusal(Reason.AUTH_FAILED, f"{self.peer} sent {message.TAG} instead of a challenge")
        expected = server_proof(self._key, self.client_nonce, message.nonce, self.agent_id, message.agent_id)
        if not hmac.compare_digest(expected, message.proof):
            raise refusal(
                Reason.AUTH_FAILED,
                f"{self.peer} ({message.agent_id}) did not prove it "
                f"holds the shared secret: the two sides hold "
                f"different secrets",
                hint=WRONG_KEY_HINT,
            )
        self.peer_agent_id = message.agent_id
        self.state = ClientState.RESULT
        proof = client_proof(self._key, self.client_nonce, message.nonce, self.agent_id, message.agent_id)
        return encode(AuthProof(nonce=message.nonce, proof=proof))

    def _on_result(self, message: AuthMessage) -> None:
        if not isinstance(message, AuthResult):
            raise refusal(Reason.AUTH_FAILED, f"{self.peer} sent {message.TAG} instead of a result")
        self.state = ClientState.DONE


def _describe(frame: bytes, error: ProtocolError) -> str:
    """What a listener without authentication sent instead of a challenge (its Close's text)."""
    try:
        message = protocol_decode(frame)
    except ProtocolError:
        return f"a frame that is not part of it ({error.message})"
    if isinstance(message, Close):
        return f"a close: {message.reason_text or 'no reason given'}"
    return f"a {message.TAG} frame"
