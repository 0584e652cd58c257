"""Sessions over ZeroMQ: one :class:`Session` per peer, on a DEALER or a ROUTER.

Decode (and a prefill rank announcing itself) *connects*: a DEALER per peer,
:class:`OutgoingChannel`. Prefill *listens*: one ROUTER for all decode peers,
:class:`IncomingChannels`, one session per ZeroMQ identity. Both hand every
received message to a callback, answer protocol violations with the reply the
session prepares (a Close, or a room-level Done/Abort), and never let a bad
frame stop the loop.

With authentication on (:mod:`pd_transfer.agent.auth`), an outgoing channel
runs the handshake before its first frame leaves, and the ROUTER lets a frame
reach a session only from an identity that completed it: a frame sent before
is dropped, counted (``bad_frames{reason="unauthenticated"}``) and answered
with a Close, and no session is created for it.

Each channel follows its peer's connection (``disconnected_s``): an outgoing
one through its socket's monitor (down at a disconnect, up at a completed
ZeroMQ handshake), an incoming one through the ROUTER's, whose disconnect
names the descriptor the session's frames came on (up again at a frame on a
newer connection). With the context's ``peer_keepalive``, the kernel also
closes a connection whose peer's host stopped answering: such a channel is
``watched``, and its connection being up says the peer's process is there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_transfer.agent.auth import (
    REFUSAL_LINGER_MS,
    Doorman,
    authenticate,
    close_reply,
    peer_key,
    security_of,
    source_fd,
)
from pd_transfer.agent.peer_process import ProcessIdentity
from pd_transfer.agent.zmq_bounds import CONTROL_QUEUED_FRAMES, ConnectionWatch, bound_frames, watch_peers
from pd_transfer.errors import PdTransferError, ProtocolError, Reason, RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, Dropped, Heartbeat, Message, Session, encode
from pd_transfer.security.identity import Identity

log = logging.getLogger(__name__)

OnMessage = Callable[["Channel", Message], Awaitable[None]]
CLOSE_SEND_TIMEOUT_S = 1.0  # how long a Close that ends a session may wait to leave


def _without_frames(err: PdTransferError) -> PdTransferError:
    """``err`` kept past its handler: without its traceback, whose frames hold the peer's
    frame (up to 16 MiB) and this channel, a cycle only the garbage collector would free:
    a peer sending bad frames fast would make the sidecar hold dozens of them."""
    err.__context__ = err.__cause__ = None  # (a chained error's traceback holds them too)
    return err.with_traceback(None)


class Channel:
    """One session with one peer; ``send`` checks the message against the table."""

    def __init__(self, session: Session, label: str) -> None:
        self.session = session
        self.label = label  # who the peer is, for logs and reasons
        self.peer_agent_id = ""
        self.proven_agent_id = ""  # the agent id the peer's handshake proved ('' auth off)
        self.proven_identity: Identity | None = None  # what its identity key holds (identity on)
        self.last_heard_s = time.monotonic()
        # when this side last sent the peer a frame: a peer that heard nothing from us for
        # longer than its heartbeat limit (this process was stopped) has dropped the session
        self.last_sent_s = self.last_heard_s
        # the peer's heartbeat limit, where known (0: unknown), and the longest stretch this
        # side sent nothing for beyond it: the peer has dropped the session by then
        self.peer_limit_s = 0.0
        self.silent_gap_s = 0.0
        self.bad_frames = 0
        self.closed = False
        self.peer_rank = ""  # the peer's rank id once known
        # since when (time.monotonic) ZeroMQ reports the connection down; None while it is up
        self.disconnected_s: float | None = None
        # whether the kernel's keepalive watches the connection (a vanished host's closes
        # even without a FIN): then a connection up means the peer's process is there
        self.watched = False
        # the peer's process where it is on this host and visible here (agent/peer_process.py),
        # and the longest stall of its loop that its last heartbeat reported
        self.peer_process: ProcessIdentity | None = None
        self.peer_stall_s = 0.0
        self.on_bad_frame: Callable[[str], None] = lambda reason: None
        # why this side ended the session (it sent the peer a Close), None otherwise;
        # on_refused(channel) is called then, once the session is dropped
        self.refusal: PdTransferError | None = None
        self.on_refused: Callable[[Channel], None] = lambda channel: None
        self.last_beat_s = 0.0  # when the sidecar's timers last sent it a heartbeat

    async def send(self, message: Message) -> None:
        frame = self.session.send(message)
        now = time.monotonic()
        if self.peer_limit_s and now - self.last_sent_s > self.peer_limit_s:
            self.silent_gap_s = max(self.silent_gap_s, now - self.last_sent_s)
        await self._write(frame)
        self.last_sent_s = now

    async def _write(self, frame: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """End the session on this side."""
        self.closed = True

    def revoke(self) -> None:
        """End the session and its connection for good: the peer proved the secret but
        broke the rules of the name it proved (this side sent it a Close saying so)."""
        self.close()

    async def receive(self, frame: bytes, on_message: OnMessage) -> None:
        self.last_heard_s = time.monotonic()
        try:
            event = self.session.receive_data(frame)
        except RemoteProtocolError as err:
            self.bad_frames += 1
            self.on_bad_frame(err.code.value)
            log.warning("peer %s: protocol error: %s", self.label, err)
            try:
                await self._write(self.session.send(err.reply))
            except Exception:  # the session may refuse once failed; the peer is gone anyway
                log.debug("peer %s: could not send the error reply", self.label)
            if isinstance(err.reply, Close):
                self.closed, self.refusal = True, _without_frames(err)
            return
        except ProtocolError as err:
            # a frame the codec knows but no session may carry (a bootstrap message
            # on the control socket): refuse it like any other bad frame
            self.bad_frames += 1
            self.on_bad_frame(err.code.value)
            log.warning("peer %s: frame refused: %s", self.label, err)
            try:
                await self._write(encode(Close(reason=err.code, reason_text=str(err)[:4000])))
            except Exception:
                log.debug("peer %s: could not send the refusal", self.label)
            # the peer was sent a Close: the session is over
            self.closed, self.refusal = True, _without_frames(err)
            return
        if isinstance(event, Dropped):
            log.info("peer %s: dropped %s: %s", self.label, event.code.value, event.text)
            return
        if isinstance(event, Heartbeat):
            self.peer_stall_s = event.stalled_s
        await on_message(self, event)


class OutgoingChannel(Channel):
    def __init__(
        self, context: zmq.asyncio.Context, address: str, role: Role, label: str, server_key: str = ""
    ) -> None:
        super().__init__(Session(role), label)
        self.address = address
        self._security = security_of(context)
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        bound_frames(self._socket)
        self._keepalive = watch_peers(self._socket, context)
        self._security.connecting(self._socket, server_key)  # the listener's own key, if known
        # watched before it connects: the handshake may complete before start() runs
        self._monitor = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._socket.connect(address)
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        # set when frames may flow: at once without authentication, else once
        # the handshake (run by the reader) succeeded or failed (auth_error)
        self._authenticated = asyncio.Event()
        self.auth_error: PdTransferError | None = None
        if not self._security.enabled:
            self._authenticated.set()

    async def _write(self, frame: bytes) -> None:
        if not self._authenticated.is_set():
            if self._reader is None:
                raise PdTransferError(f"peer {self.label}: send before start()", code=Reason.SESSION_CLOSED)
            await self._authenticated.wait()
        if self.auth_error is not None:
            raise self.auth_error
        await self._socket.send(frame)

    def start(self, on_message: OnMessage) -> None:
        self._reader = asyncio.create_task(self._read(on_message))
        self._watcher = asyncio.create_task(self._watch_connection())

    async def _watch_connection(self) -> None:
        """Follow the connection's ups and downs (``disconnected_s``): a peer process that
        dies closes its sockets, and the agent need not wait for its heartbeats to stop.
        Up is a completed ZeroMQ handshake, not a TCP connect: the kernel of a host whose
        peer process is stopped still accepts connections that nobody answers."""
        monitor = self._monitor
        try:
            while not self.closed:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self.disconnected_s = self.disconnected_s or time.monotonic()
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # watched once it was up
                    self.disconnected_s, self.watched = None, self._keepalive is not None
        except zmq.ZMQError as err:  # the socket closed under the monitor
            log.debug("peer %s: connection monitor stopped: %s", self.label, err)
        finally:
            monitor.close(linger=0)

    async def _read(self, on_message: OnMessage) -> None:
        if not self._authenticated.is_set():
            try:
                await authenticate(self._socket, self._security, f"peer {self.label}")
            except PdTransferError as err:
                self.auth_error, self.closed = err, True
                self._socket.close(linger=REFUSAL_LINGER_MS)
            finally:
                self._authenticated.set()
        while not self.closed:
            frame = await self._socket.recv()
            try:
                await self.receive(frame, on_message)
            except Exception:
                log.exception("peer %s: handler failed", self.label)
        if self.refusal is not None:  # this side sent a Close: let it leave, read no more
            self.close(linger_ms=REFUSAL_LINGER_MS)
            self.on_refused(self)

    def revoke(self) -> None:
        self.close(linger_ms=REFUSAL_LINGER_MS)

    def close(self, linger_ms: int = 0) -> None:
        """Stop the session; ``linger_ms`` lets frames already sent (a Close) leave first."""
        self.closed = True
        if not self._authenticated.is_set():  # release senders waiting for the handshake
            self.auth_error = PdTransferError(
                f"peer {self.label}: closed before authenticating", code=Reason.SESSION_CLOSED
            )
            self._authenticated.set()
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._monitor.close(linger=0)  # (a watcher cancelled before it ran closes nothing)
        self._socket.close(linger=linger_ms)


class IncomingChannel(Channel):
    def __init__(self, router: IncomingChannels, identity: bytes, role: Role) -> None:
        super().__init__(Session(role), f"peer {identity.hex()[:8]}")
        self._router = router
        self.identity = identity
        self.fd: int | None = None  # the descriptor its latest frame came on (SRCFD)
        self.down_event = 0  # the ROUTER's event count when its connection went down
        self.watched = router.keepalive is not None

    async def _write(self, frame: bytes) -> None:
        await self._router.socket.send_multipart([self.identity, frame])

    def close(self) -> None:
        """Forget the session (the peer closed it or was lost); a new frame from the
        same identity starts a new one."""
        self.closed = True
        if self._router.channels.get(self.identity) is self:
            del self._router.channels[self.identity]

    def revoke(self) -> None:
        self.close()
        self._router.doorman.revoke(self.identity, self.fd)


class IncomingChannels:
    """The ROUTER prefill listens on; a session per connecting decode peer."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        host: str,
        port: int,
        role: Role,
        *,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_refused: Callable[[Channel], None] = lambda channel: None,
        on_closed: Callable[[str], None] = lambda socket: None,
    ) -> None:
        self._on_bad_frame = on_bad_frame
        self._on_refused = on_refused
        security = security_of(context)
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        bound_frames(
            self.socket, queued_frames=CONTROL_QUEUED_FRAMES, handshake_timeout_s=security.lobby.timeout_s
        )
        self.keepalive = watch_peers(self.socket, context)
        security.listening(self.socket, identified=True, as_self=True)  # its identity key, if any
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        door = security.lobby.door("control", active=security.enabled)  # agent/lobby.py
        door.bound(self.address)
        self.doorman = Doorman(
            self.socket,
            security,
            f"control {self.address}",
            close_reply,
            on_bad_frame=on_bad_frame,
            door=door,
            identified=True,
        )
        self._role = role
        self.channels: dict[bytes, IncomingChannel] = {}
        self._door = door
        self._events = 0  # the monitor's accept and disconnect events handled so far
        self._accepted: dict[int, int] = {}  # fd -> the event count at its latest accept
        self.watch = ConnectionWatch(
            self.socket,
            "control",
            f"control {self.address}",
            on_closed=on_closed,
            on_bad_frame=on_bad_frame,
            on_accepted=self._connection_accepted,
            on_disconnected=self._connection_ended,
        )

    def _connection_accepted(self, fd: int) -> None:
        self._events += 1
        self._accepted[fd] = self._events
        self._door.accepted(fd)

    def _connection_ended(self, fd: int) -> None:
        """The connection on ``fd`` closed: the sessions whose frames came on it are down."""
        self._events += 1
        self._accepted.pop(fd, None)
        self._door.disconnected(fd)
        now = time.monotonic()
        for channel in self.channels.values():
            if channel.fd == fd and channel.disconnected_s is None:
                channel.disconnected_s, channel.down_event = now, self._events

    def _heard_on(self, channel: IncomingChannel, fd: int | None) -> None:
        """A frame of ``channel`` came on ``fd``: up again if that is a newer connection
        than the one that ended (a frame the old one left queued is not). The connection
        events ZeroMQ queued before the frame are handled first: a descriptor that another
        session's connection left is not taken for this one's (they were drained before the
        doorman too, which judges a frame of a connection that ended since as it was sent)."""
        self.watch.drain()
        if channel.disconnected_s is not None and fd is not None:
            if fd != channel.fd or self._accepted.get(fd, 0) > channel.down_event:
                channel.disconnected_s = None
        channel.fd = fd

    async def serve(self, on_message: OnMessage) -> None:
        watching = asyncio.create_task(self.watch.run())
        try:
            await self._serve(on_message)
        finally:
            watching.cancel()

    async def _serve(self, on_message: OnMessage) -> None:
        while True:
            parts = await self.socket.recv_multipart(copy=False)
            if len(parts) != 2:
                self._on_bad_frame(Reason.BAD_FRAME.value)
                log.warning("control socket: dropped a message of %d frames", len(parts))
                continue
            identity, frame, fd = parts[0].bytes, parts[1].bytes, source_fd(parts[1])
            self.watch.drain()  # the connection's ends heard first: a late frame is still judged
            if not await self.doorman.admit(identity, frame, fd, peer_key(parts[1])):
                continue
            channel = self.channels.get(identity)
            if channel is None or channel.closed:
                channel = self.channels[identity] = IncomingChannel(self, identity, self._role)
                channel.proven_agent_id = self.doorman.proven_agent_id(identity)
                channel.proven_identity = self.doorman.proven_identity(identity)
                channel.on_bad_frame, channel.on_refused = self._on_bad_frame, self._on_refused
            self._heard_on(channel, fd)
            try:
                await channel.receive(frame, on_message)
            except Exception:
                log.exception("peer %s: handler failed", channel.label)
            if channel.refusal is not None:  # this side sent a Close: forget the session (a
                channel.close()  # peer sending bad frames, each from a new
                channel.on_refused(channel)  # identity, must not pile sessions up)

    def close(self) -> None:
        self.socket.close(linger=0)
