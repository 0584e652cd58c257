"""The worker-facing endpoint: a ROUTER on ``ipc://`` (or a ``unix://`` stream) serving the worker API.

Each request is decoded and validated by :mod:`pd_transfer.protocol.worker_api`
and handed to the role's handler as a task, so a slow request (``wait``,
``abort`` waiting for a drain) never blocks the others. A malformed request
gets an error reply with its reason; the endpoint keeps serving.

Bounded: at most ``max_requests`` requests are in progress at once (a
``wait`` counts until it returns); one more is answered at once with
``over_limit`` instead of becoming another task. Frames not yet read wait in
ZeroMQ's receive queue, bounded by its high-water mark (1000 per worker
connection by default), and then hold the worker's own send.

An ``ipc://`` socket file has mode 0600 (:func:`bind_private`), like a
``unix://`` one: only the sidecar's user (and root) may connect.

A ``unix://PATH`` address serves the same frames on a plain Unix stream
socket instead (:mod:`pd_transfer.agent.stream_router`): the same requests,
limits and handshake, about a third of ZeroMQ's round trip on a small host.

Each request reaches the handler with the connection it came on (a file
descriptor for ZeroMQ, read from the frame's ``SRCFD``; the connection's id
for ``unix://``), and ``on_closed(connection)`` is called when a connection
closes: the worker's process ended, or it closed its client. The sidecar
ties the worker's registration to its connection this way
(:mod:`pd_transfer.agent.worker_loss`).

With authentication on, a worker's client runs the handshake first
(:mod:`pd_transfer.agent.auth`); a request sent without it gets an error
reply with the code ``unauthenticated`` and never reaches the handler. Until
then a ZeroMQ connection is a stranger of the lobby's ``worker`` door
(:mod:`pd_transfer.agent.lobby`): at most 64 of them, one handshake deadline,
256 KiB received on ``tcp://``; ``unix://`` has its own bounds (4 KiB a frame).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import zmq
import zmq.asyncio

from pd_transfer.agent.auth import Doorman, security_of
from pd_transfer.agent.lobby import Door
from pd_transfer.agent.stream_router import MAX_PENDING, StreamRouter
from pd_transfer.agent.zmq_bounds import ConnectionWatch, bound_frames
from pd_transfer.errors import AuthError, PdTransferError, Reason
from pd_transfer.protocol import worker_api
from pd_transfer.protocol.stream_frames import unix_path
from pd_transfer.protocol.worker_api import WorkerApiError
from pd_transfer.protocol.worker_requests import WorkerRequest, read_request

log = logging.getLogger(__name__)

# (op, request, connection): ``connection`` is None where it cannot be told (no SRCFD)
Handler = Callable[[WorkerRequest, Hashable | None], Awaitable[dict[str, Any]]]


class WorkerEndpoint:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        handler: Handler,
        *,
        on_bad_request: Callable[[str], None] = lambda reason: None,
        max_requests: int = 8192,
        on_over_limit: Callable[[], None] = lambda: None,
        on_closed: Callable[[Hashable], None] = lambda connection: None,
        on_connection_closed: Callable[[str], None] = lambda socket: None,
    ) -> None:
        self._on_bad_request = on_bad_request
        self._on_closed = on_closed
        # ZeroMQ: how many connections closed on each descriptor; a connection is
        # (descriptor, that count when its request came), so a reused descriptor is another one
        self._closed_on: dict[int, int] = {}
        self.max_requests = max_requests
        self._on_over_limit = on_over_limit
        path = unix_path(address)
        security = security_of(context)
        if path is not None:
            self._socket: StreamRouter | zmq.asyncio.Socket = StreamRouter(
                path,
                on_bad_frame=self._count_bad_request,
                on_closed=on_closed,
                authenticated=lambda identity: self._doorman.authenticated(identity),
                handshake_timeout_s=security.handshake_timeout_s,
            )
            self._watch: ConnectionWatch | None = None
            self._door: Door | None = None
        else:
            self._socket, self._door, self._watch = self._zmq_router(context, address, on_connection_closed)
        self.address = address
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.bad_requests = 0
        self._doorman = Doorman(
            self._socket,
            security,
            "worker endpoint",
            _refusal_reply,
            on_bad_frame=self._count_bad_request,
            door=self._door,
        )

    def _zmq_router(
        self, context: zmq.asyncio.Context, address: str, on_connection_closed: Callable[[str], None]
    ) -> tuple[zmq.asyncio.Socket, Door, ConnectionWatch]:
        """The ROUTER of an ``ipc://`` or ``tcp://`` endpoint, the :class:`Door` that bounds its
        strangers until their handshake (how many, how long, how many bytes: agent/lobby.py),
        and the watch that counts every ended connection and tells which descriptor's (the
        worker's registration)."""
        security = security_of(context)
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        bound_frames(socket, worker_api.MAX_REQUEST_NBYTES, handshake_timeout_s=security.handshake_timeout_s)
        bind_private(socket, address)
        door = security.lobby.door(
            "worker",
            active=security.enabled,
            max_pending=MAX_PENDING,
            timeout_s=security.handshake_timeout_s,
            local=True,
        )
        door.bound(socket.getsockopt_string(zmq.LAST_ENDPOINT))

        def disconnected(fd: int) -> None:
            door.disconnected(fd)
            self._closed_descriptor(fd)

        watch = ConnectionWatch(
            socket,
            "worker",
            f"worker endpoint {address}",
            on_closed=on_connection_closed,
            on_bad_frame=self._count_bad_request,
            on_accepted=door.accepted,
            on_disconnected=disconnected,
        )
        return socket, door, watch

    def _count_bad_request(self, reason: str) -> None:
        self.bad_requests += 1
        self._on_bad_request(reason)

    async def serve(self) -> None:
        if isinstance(self._socket, StreamRouter):
            await self._socket.start()
        elif self._watch is not None:  # ZeroMQ's endpoints are watched
            self._watcher = asyncio.create_task(self._watch.run())
        while True:
            frames, connection = await self._receive()
            if len(frames) != 2:
                self.bad_requests += 1
                self._on_bad_request(Reason.BAD_FRAME.value)
                log.warning("worker endpoint: dropped a request of %d frames", len(frames))
                continue
            identity, frame = frames
            fd = connection[0] if isinstance(connection, tuple) else None
            if not await self._doorman.admit(identity, frame, fd):
                continue
            if len(self._tasks) >= self.max_requests:
                await self._refuse_busy(identity, frame)
                continue
            task = asyncio.create_task(self._answer(identity, frame, connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _receive(self) -> tuple[list[bytes], Hashable | None]:
        """The next request's frames, and the connection it came on."""
        if isinstance(self._socket, StreamRouter):
            frames = await self._socket.recv_multipart()
            return frames, frames[0]
        parts = await self._socket.recv_multipart(copy=False)
        try:
            fd = parts[-1].get(zmq.SRCFD)
            connection = (fd, self._closed_on.get(fd, 0))
        except zmq.ZMQError:  # a libzmq without it: the worker's connection is not watched
            connection = None
        return [part.bytes for part in parts], connection

    def is_open(self, connection: Hashable | None) -> bool:
        """Whether ``connection`` is still open (True when it cannot be told)."""
        if connection is None:
            return True
        if isinstance(self._socket, StreamRouter):  # the connection is the stream's identity
            return not isinstance(connection, bytes) or self._socket.is_open(connection)
        if not isinstance(connection, tuple):  # ZeroMQ's: (descriptor, closes on it then)
            return True
        fd, closed = connection
        return bool(self._closed_on.get(fd, 0) == closed)

    def _closed_descriptor(self, fd: int) -> None:
        """ZeroMQ: the ROUTER's monitor says the connection on ``fd`` closed."""
        closed = self._closed_on.get(fd, 0)
        self._closed_on[fd] = closed + 1
        self._on_closed((fd, closed))

    async def _answer(self, identity: bytes, frame: bytes, connection: Hashable | None) -> None:
        request_id = -1
        try:
            request = read_request(frame)  # one record per operation (protocol/worker_requests.py)
            request_id = request.id
            reply = worker_api.ok_reply(request_id, **(await self._handler(request, connection)))
        except WorkerApiError as err:
            self.bad_requests += 1
            self._on_bad_request(err.code.value)
            log.warning("worker endpoint: bad request: %s", err)
            reply = worker_api.error_reply(err.request_id if err.request_id >= 0 else request_id, err)
        except PdTransferError as err:
            reply = worker_api.error_reply(request_id, err)
        except Exception as err:  # a bug must not take the endpoint down
            log.exception("worker endpoint: request %s failed", request_id)
            reply = worker_api.error_reply(
                request_id, PdTransferError(f"internal error: {err!r}", code=Reason.BAD_FRAME)
            )
        try:
            await self._socket.send_multipart([identity, reply])
        except zmq.ZMQError as err:
            log.warning("worker endpoint: cannot reply to request %s: %s", request_id, err)

    async def _refuse_busy(self, identity: bytes, frame: bytes) -> None:
        self._on_over_limit()
        error = PdTransferError(
            f"{len(self._tasks)} worker requests are in progress, the limit is "
            f"max_worker_requests={self.max_requests}",
            code=Reason.OVER_LIMIT,
            hint="poll instead of keeping many waits open, or raise max_worker_requests",
        )
        log.warning("worker endpoint: %s", error.message)
        try:
            await self._socket.send_multipart([identity, _refusal_reply(frame, error)])
        except zmq.ZMQError as err:
            log.warning("worker endpoint: cannot refuse a request: %s", err)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        if isinstance(self._socket, StreamRouter):
            self._socket.close()  # it removes its socket file
            return
        self._socket.disable_monitor()  # the watch closes its monitor socket
        self._socket.close(linger=0)
        if self.address.startswith("ipc://"):  # libzmq leaves the socket file behind
            try:
                os.unlink(self.address[len("ipc://") :])
            except OSError:
                pass


def bind_private(socket: zmq.Socket[object], address: str) -> None:
    """Bind ``address``; an ``ipc://`` socket file is made mode 0600, as ``unix://``'s is.

    libzmq creates the file with the mode the umask leaves (0755 under the usual 022,
    0777 under 000), and listens at once, so a chmod afterwards would leave a moment in
    which any local user could connect: the umask is narrowed around the bind instead
    (at startup, before the sidecar makes files on other threads), then the mode is set
    again in case the file system ignored it.
    """
    if not address.startswith("ipc://"):
        socket.bind(address)
        return
    umask = os.umask(0o177)
    try:
        socket.bind(address)
    finally:
        os.umask(umask)
    os.chmod(address[len("ipc://") :], 0o600)


def _refusal_reply(frame: bytes, error: AuthError | PdTransferError) -> bytes:
    """An error reply to a request refused unread (before the handshake, or over the
    limit), with the request's id when it has one, so the worker's call fails with
    the reason instead of timing out."""
    try:
        request_id = worker_api.decode_request(frame)[1]["id"]
    except WorkerApiError:
        request_id = -1
    return worker_api.error_reply(request_id, error)
