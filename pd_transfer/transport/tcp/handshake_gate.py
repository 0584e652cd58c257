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

:meth:`GatedConnection.serve` is every such connection's thread: the
handshake first, then the receiver's frames, and one way of logging,
counting and reporting whatever ends the stream.
:meth:`GatedConnection.authenticate` runs the handshake on the connection's
thread and sorts its failures the same way for every such receiver: garbage
(a stream error) is a bad frame, a refused handshake is counted (the
authenticator logged it), a cut-off or a timeout is a bad frame with its
reason.

The first frame's declared header size is bounded by the caller, from its
prefix, before a byte of it is read (:data:`~pd_transfer.transport.tcp.sockets.MAX_HANDSHAKE_NBYTES`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.tcp.sockets import (
    MAX_HANDSHAKE_NBYTES,
    STREAM_ERRORS,
    FrameChannel,
    Kind,
    PeerClosed,
    Prefix,
    recv_exact,
    shutdown,
)


class GatedConnection:
    """One accepted connection's standing: pending (``authenticated is None``) until
    it authenticates (True) or is refused or cut off (False). Served by its own
    thread; the receiver's event loop may cut it off meanwhile."""

    receiver: Any  # the subclass's: tcp's ThreadedReceiver, or the engines' staging receiver

    def __init__(self, sock: socket.socket, where: str, *, pending: bool) -> None:
        self.sock = sock
        self.where = where
        self.authenticated: bool | None = None if pending else True
        self.cut_off: tuple[Reason, str] | None = None  # why the receiver ended the handshake
        self.holds_slot = False  # counted among the receiver's authenticated connections
        self.peer_agent = ""  # who authenticated (the authenticator's name for the peer)
        self._state = threading.Lock()

    def serve(self) -> None:
        """The connection thread's body: the handshake when the receiver authenticates,
        then :meth:`_frames` until the peer closes. What ends the stream is logged,
        counted and reported once (a prefix that is not ours is a bad frame; a bug of
        ours is logged, never a silently dead thread), then the socket is closed.

        Subclasses set ``receiver`` (a :class:`~pd_transfer.transport.tcp.serving.ThreadedReceiver`)
        and give :meth:`_frames`, :meth:`_handshake_head` and :meth:`_refuse_unauthenticated`.
        """
        receiver = self.receiver
        try:
            if receiver.auth is not None and not self.authenticate(
                receiver, self._handshake_head, self._refuse_unauthenticated
            ):
                self.settle(ok=False)
                return
            self._frames()
        except TransportError as err:  # a prefix that is not ours: the stream is lost
            receiver.bad_frame(err.code, err.message, self.where)
        except PeerClosed as err:
            if err.partial:
                receiver.log.info(
                    "%s %s: %s went away mid-frame", receiver.label, receiver.address, self.where
                )
        except OSError as err:
            receiver.log.info("%s %s: %s: %s", receiver.label, receiver.address, self.where, err)
        except Exception:  # never let a bug of ours kill the thread silently
            receiver.log.exception(
                "%s %s: %s: frame handling failed", receiver.label, receiver.address, self.where
            )
            receiver.count(Reason.TRANSPORT_FAILED)
        finally:
            self._ended()
            self.shutdown()
            self.sock.close()

    def _frames(self) -> None:
        """Serve the authenticated stream until the peer closes it."""
        raise NotImplementedError

    def _handshake_head(self) -> Prefix | None:
        """Read the first frame's prefix, bounded for a stranger."""
        raise NotImplementedError

    def _refuse_unauthenticated(self, head: Prefix) -> None:
        """Answer a first frame that is not a handshake."""
        raise NotImplementedError

    def _ended(self) -> None:
        """The connection ends (its thread, before the socket closes)."""

    def authenticate(
        self, receiver, read_head: Callable[[], Prefix | None], refuse: Callable[[Prefix], None]
    ) -> bool:
        """Run the server side of the handshake; True once the connection is authenticated
        and holds one of ``receiver``'s slots (:meth:`admit_authenticated`).

        ``read_head()`` reads the first frame's prefix (bounded by the caller);
        ``refuse(head)`` answers a first frame that is not a handshake.
        """
        self.sock.settimeout(receiver.handshake_timeout_s)  # the gate's deadline cuts in earlier
        try:
            head = read_head()
            if head is None:  # closed: by the peer, or cut off by the gate
                raise PeerClosed(partial=False)
            if head.kind is not Kind.HANDSHAKE:
                refuse(head)
                return False
            if head.header_nbytes > MAX_HANDSHAKE_NBYTES or head.payload_nbytes:
                raise TransportError(
                    f"a handshake frame of {head.header_nbytes} header and "
                    f"{head.payload_nbytes} payload bytes exceeds the limits "
                    f"({MAX_HANDSHAKE_NBYTES}, 0)",
                    code=Reason.FRAME_TOO_LARGE,
                )
            first = recv_exact(self.sock, head.header_nbytes)
            where = f"{receiver.address}: {self.where}"
            self.peer_agent = receiver.auth.server(first, FrameChannel(self.sock), where)
        except TransportError as err:
            if err.code in STREAM_ERRORS:  # garbage, not a refused handshake (counted there)
                receiver.bad_frame(err.code, err.message, self.where)
            else:
                receiver.count(err.code)
            return False
        except OSError as err:  # PeerClosed too: a cut-off shuts the socket down
            if self.cut_off is not None:
                receiver.bad_frame(*self.cut_off, self.where)
            elif isinstance(err, TimeoutError):
                receiver.bad_frame(
                    Reason.TIMEOUT,
                    f"no authentication handshake within {receiver.handshake_timeout_s:g} s",
                    self.where,
                )
            else:
                raise
            return False
        self.sock.settimeout(None)
        if not self.settle():
            return False  # cut off just as it finished
        return receiver.admit_authenticated(self)

    def shutdown(self) -> None:
        """Wake the thread out of any blocking call: the connection ends."""
        shutdown(self.sock)

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
