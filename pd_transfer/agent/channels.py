"""Sessions over ZeroMQ: one :class:`Session` per peer, on a DEALER or a ROUTER.

Decode (and a prefill rank announcing itself) *connects*: a DEALER per peer,
:class:`OutgoingChannel`. Prefill *listens*: one ROUTER for all decode peers,
:class:`IncomingChannels`, one session per ZeroMQ identity. Both hand every
received message to a callback, answer protocol violations with the reply the
session prepares (a Close, or a room-level Done/Abort), and never let a bad
frame stop the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from pd_transfer.errors import RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close, Dropped, Message, Session

log = logging.getLogger(__name__)

OnMessage = Callable[["Channel", Message], Awaitable[None]]


class Channel:
    """One session with one peer; ``send`` checks the message against the table."""

    def __init__(self, session: Session, label: str) -> None:
        self.session = session
        self.label = label            # who the peer is, for logs and reasons
        self.peer_agent_id = ""
        self.last_heard_s = time.monotonic()
        self.bad_frames = 0
        self.closed = False
        self.peer_rank = ""           # the peer's rank id once known
        self.on_bad_frame: Callable[[str], None] = lambda reason: None

    async def send(self, message: Message) -> None:
        frame = self.session.send(message)
        await self._write(frame)

    async def _write(self, frame: bytes) -> None:
        raise NotImplementedError

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
                self.closed = True
            return
        if isinstance(event, Dropped):
            log.info("peer %s: dropped %s: %s", self.label, event.code.value, event.text)
            return
        await on_message(self, event)


class OutgoingChannel(Channel):
    def __init__(self, context: zmq.asyncio.Context, address: str, role: Role, label: str) -> None:
        super().__init__(Session(role), label)
        self.address = address
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._reader: asyncio.Task | None = None

    async def _write(self, frame: bytes) -> None:
        await self._socket.send(frame)

    def start(self, on_message: OnMessage) -> None:
        self._reader = asyncio.create_task(self._read(on_message))

    async def _read(self, on_message: OnMessage) -> None:
        while not self.closed:
            frame = await self._socket.recv()
            try:
                await self.receive(frame, on_message)
            except Exception:
                log.exception("peer %s: handler failed", self.label)

    def close(self) -> None:
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(linger=0)


class IncomingChannel(Channel):
    def __init__(self, router: IncomingChannels, identity: bytes, role: Role) -> None:
        super().__init__(Session(role), f"peer {identity.hex()[:8]}")
        self._router = router
        self.identity = identity

    async def _write(self, frame: bytes) -> None:
        await self._router.socket.send_multipart([self.identity, frame])


class IncomingChannels:
    """The ROUTER prefill listens on; a session per connecting decode peer."""

    def __init__(self, context: zmq.asyncio.Context, host: str, port: int, role: Role, *,
                 on_bad_frame: Callable[[str], None] = lambda reason: None) -> None:
        self._on_bad_frame = on_bad_frame
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._role = role
        self.channels: dict[bytes, IncomingChannel] = {}

    async def serve(self, on_message: OnMessage) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                log.warning("control socket: dropped a message of %d frames", len(frames))
                continue
            identity, frame = frames
            channel = self.channels.get(identity)
            if channel is None or channel.closed:
                channel = self.channels[identity] = IncomingChannel(self, identity, self._role)
                channel.on_bad_frame = self._on_bad_frame
            try:
                await channel.receive(frame, on_message)
            except Exception:
                log.exception("peer %s: handler failed", channel.label)

    def close(self) -> None:
        self.socket.close(linger=0)
