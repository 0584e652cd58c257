"""The worker's side of authentication: which secret, and reading the sidecar's answers.

A client authenticates when it has a secret: the ``secret`` (or
``secret_file``) given to its constructor, else the sidecar's own sources,
``PD_TRANSFER_SECRET_FILE`` or ``PD_TRANSFER_SECRET``. It runs the handshake
of :mod:`pd_transfer.security.handshake` before its first request (and again
after the sidecar says ``unauthenticated``, e.g. once it restarted).

Sans-IO: the blocking and the asyncio client move the frames.
"""

from __future__ import annotations

from pd_transfer.client import calls as wire
from pd_transfer.client.errors import AuthFailed
from pd_transfer.errors import AuthError
from pd_transfer.security import ClientHandshake, SharedSecret, load_secret, parse_secret


def client_secret(secret: bytes | str | None, secret_file: str) -> SharedSecret | None:
    """The secret to authenticate with, None for none (ConfigError if unusable)."""
    if secret is not None and secret_file:
        raise ValueError("give secret or secret_file, not both")
    if secret is not None:
        if not isinstance(secret, (bytes, str)):
            raise TypeError(f"secret: expected bytes or str, got {type(secret).__name__}")
        return parse_secret(secret.encode() if isinstance(secret, str) else secret, "secret")
    return load_secret(secret_file)


def step(handshake: ClientHandshake, frame: bytes) -> bytes | None:
    """The next handshake frame to send (or None) after ``frame``; AuthError on failure.

    A late reply to an earlier call (it has a request id) is skipped; a
    worker-API refusal means the sidecar does not run the handshake.
    """
    request_id, reply = wire.reply_id(frame)
    if request_id is not None and request_id >= 0:
        return None
    if reply is not None and reply.get("ok") is False:
        raise AuthError(
            f"{handshake.peer} answered the handshake with an error: "
            f"{reply.get('reason')!s:.300}; is authentication on at the sidecar?"
        )
    return handshake.receive(frame)


def failed(op: str, error: AuthError) -> AuthFailed:
    return AuthFailed(op, error.message, code=error.code, hint=error.hint)
