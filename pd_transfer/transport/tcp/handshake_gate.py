"""The gate a threaded receiver keeps between a stranger's connection and its service.

The tcp data receiver (:mod:`~pd_transfer.transport.tcp.receiver`) and the engines' staging channel
(:mod:`~pd_transfer.transport.engines.staging.receiver`) accept plain sockets and, with authentication on,
serve a connection only once it proved the shared secret. Until then it is a
stranger's, and the gate bounds what a stranger can hold:

- **one deadline** for the whole handshake, counted from the accept
  (:func:`arm_deadline`): the receiver shuts the connection down when it
  passes, however slowly bytes trickle in (a per-read timeout would let one
  byte every few seconds hold the connection for ever);
- **a cap on pending connections**, separate from the authenticated ones
  (:func:`make_room`): one more stranger shuts the oldest pending one down,
  so a flood of idle connections cannot keep out a real peer, which
  authenticates in a round trip or two;
- a connection authenticated just as it was cut off stays cut off
  (:meth:`GatedConnection.settle`).

The first frame's declared header size is bounded by the caller, from its
prefix, before a byte of it is read (:data:`~pd_transfer.transport.tcp.sockets.MAX_HANDSHAKE_NBYTES`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterable

from pd_transfer.errors import Reason


class GatedConnection:
    """One accepted connection's standing: pending (``authenticated is None``) until
    it authenticates (True) or is refused or cut off (False). Served by its own
    thread; the receiver's event loop may cut it off meanwhile."""

    def __init__(self, sock: socket.socket, where: str, *, pending: bool) -> None:
        self.sock = sock
        self.where = where
        self.authenticated: bool | None = None if pending else True
        self.cut_off: tuple[Reason, str] | None = None  # why the receiver ended the handshake
        self.holds_slot = False  # counted among the receiver's authenticated connections
        self._state = threading.Lock()

    def shutdown(self) -> None:
        """Wake the thread out of any blocking call: the connection ends."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def cut_handshake(self, code: Reason, why: str) -> bool:
        """End the connection if it has not authenticated yet (the deadline passed, or
        room is needed for a newer one); False if it had."""
        with self._state:
            if self.authenticated is not None:
                return False
            self.authenticated, self.cut_off = False, (code, why)
        self.shutdown()
        return True

    def settle(self, ok: bool = True) -> bool:
        """The handshake ended (``ok``: it succeeded); True if the connection is now
        authenticated, False if it failed or was cut off first."""
        with self._state:
            if self.authenticated is None:
                self.authenticated = ok
            return bool(self.authenticated)


def arm_deadline(loop: asyncio.AbstractEventLoop, connection: GatedConnection, timeout_s: float) -> None:
    """Cut ``connection`` off ``timeout_s`` from now unless it authenticated by then."""
    loop.call_later(
        timeout_s,
        connection.cut_handshake,
        Reason.TIMEOUT,
        f"no authentication handshake within {timeout_s:g} s of the connection",
    )


def make_room(connections: Iterable[GatedConnection], max_pending: int) -> None:
    """At ``max_pending`` connections that have not authenticated, shut the oldest down
    (``connections`` in accept order)."""
    pending = [c for c in connections if c.authenticated is None]
    for connection in pending[: max(0, len(pending) - max_pending + 1)]:
        connection.cut_handshake(
            Reason.LIMIT_EXCEEDED,
            f"{max_pending} connections are waiting for their "
            f"authentication handshake (max_pending): this one, the "
            f"oldest, makes room for a newer one",
        )
