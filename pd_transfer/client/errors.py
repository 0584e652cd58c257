"""Errors a worker sees from :mod:`pd_transfer.client`.

    PdTransferError
    └── ClientError          a call did not succeed; .op, .code (Reason), .code_text, .reason
        ├── Refused          the sidecar answered {"ok": false, "code", "reason"}: this
        │                    call (this room) is refused, the connection is fine
        ├── ReplyTimeout     no reply within the call's timeout (code ``timeout``)
        ├── BadReply         the reply is not a well-formed worker_api reply (``bad_frame``)
        ├── AuthFailed       this worker and the sidecar could not authenticate each other
        │                    (``auth_failed``, ``auth_replayed``: a wrong or missing secret)
        ├── SidecarLost      the connection closed or dropped during the call (``peer_lost``):
        │                    the sidecar stopped or restarted; the next call connects again
        └── ClientClosed     the client was closed before or during the call
                             (``shutting_down``)

An engine typically handles :class:`Refused` per room and treats the others
as the sidecar being gone. Local argument mistakes (a negative page index, a
bool where an int is expected) raise ``ValueError``/``TypeError`` before
anything is sent.

Imports only :mod:`pd_transfer.errors` (and :mod:`os`, to say a socket file is missing).
"""

from __future__ import annotations

import os

from pd_transfer.errors import PdTransferError, Reason


class ClientError(PdTransferError):
    """Base of the client's errors. ``reason`` is the text without the op prefix."""

    default_code = Reason.BAD_FRAME

    def __init__(
        self,
        op: str,
        reason: str,
        *,
        code: Reason | None = None,
        code_text: str | None = None,
        hint: str = "",
    ) -> None:
        super().__init__(
            self._headline(op, reason, code_text or (code or self.default_code).value), code=code, hint=hint
        )
        self.op = op
        self.reason = reason
        self.code_text = code_text or self.code.value

    @staticmethod
    def _headline(op: str, reason: str, code_text: str) -> str:
        return f"{op}: {reason}"


class Refused(ClientError):
    """The sidecar answered ``ok: false``; ``reason`` is its text, ``code`` its reason code.

    ``code`` is None-safe: a code this version does not know keeps the
    default code and its wire spelling in ``code_text``.
    """

    @staticmethod
    def _headline(op: str, reason: str, code_text: str) -> str:
        return f"{op} refused by the sidecar [{code_text}]: {reason}"


class ReplyTimeout(ClientError):
    default_code = Reason.TIMEOUT

    def __init__(self, op: str, timeout_s: float, endpoint: str) -> None:
        missing = _missing_socket(endpoint)
        super().__init__(
            op,
            f"no reply from the sidecar at {endpoint} within {timeout_s:g} s"
            + (f": no socket exists at {missing}" if missing else ""),
            hint="is `pd-transfer serve` running with this worker endpoint?"
            + (" (its --worker-endpoint, or worker_endpoint in its config)" if missing else ""),
        )


def _missing_socket(endpoint: str) -> str:
    """The path of a ``unix://`` or ``ipc://`` endpoint whose socket file does not exist."""
    scheme, _, path = endpoint.partition("://")
    if scheme in ("unix", "ipc") and path and not os.path.exists(path):
        return path
    return ""


class BadReply(ClientError):
    default_code = Reason.BAD_FRAME

    def __init__(self, op: str, problem: str) -> None:
        super().__init__(op, f"malformed reply from the sidecar: {problem}")


class AuthFailed(ClientError):
    """The handshake with the sidecar failed; no request was served. ``code`` says why."""

    default_code = Reason.AUTH_FAILED


class SidecarLost(ClientError):
    """The sidecar's connection closed or dropped during the call; whether it handled the
    request is unknown (poll the room to learn). The next call connects again."""

    default_code = Reason.PEER_LOST

    def __init__(self, op: str, why: str) -> None:
        super().__init__(op, why, hint="is `pd-transfer serve` still running? the next call connects again")


class ClientClosed(ClientError):
    default_code = Reason.SHUTTING_DOWN

    def __init__(self, op: str) -> None:
        super().__init__(op, "the client is closed")
