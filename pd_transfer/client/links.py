"""The client's connection to its sidecar: ZeroMQ ``ipc://`` or a ``unix://`` stream.

Both clients move whole worker API frames through a link and never see which
kind it is. :func:`open_link` and :func:`open_async_link` pick one by the
endpoint's scheme:

``ipc://PATH`` (or ``tcp://``)
    a ZeroMQ DEALER; it connects in the background and reconnects by itself,
    so a call to a sidecar that is not up yet simply waits. Its monitor tells
    when a connection it had was dropped (the sidecar's process ended): the
    call in flight, or a doorbell wait, raises ``ConnectionError``, and the
    next call runs on a new connection.
``unix://PATH``
    a plain Unix stream socket, frames with a length header
    (:mod:`pd_transfer.protocol.stream_frames`). No I/O thread between the
    worker and its sidecar: a round trip is several times shorter. A sidecar
    that is not up yet is connected to again every 20 ms until the call's
    deadline (a sleep, not a spin); a connection the sidecar closes raises
    ``ConnectionError`` in the call that sees it, and the next call connects
    afresh (and authenticates again). A path that still refuses connections
    :data:`~pd_transfer.client.absence.GONE_AFTER_S` after such a loss fails
    calls at once: the sidecar is gone (:mod:`pd_transfer.client.absence`).
"""

from __future__ import annotations

import asyncio
import select
import socket
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_transfer.client.absence import Absence
from pd_transfer.protocol.stream_frames import HEADER, frame_length, pack, unix_path
from pd_transfer.protocol.worker_api import WorkerApiError
from pd_transfer.security import new_routing_id

CONNECT_RETRY_S = 0.02
_RECV_NBYTES = 1 << 16


def open_link(endpoint: str, context: zmq.Context, *, random_id: bool) -> ZmqLink | StreamLink:
    """The blocking link for ``endpoint`` (ValueError for a bad ``unix://`` path)."""
    path = unix_path(endpoint)
    return StreamLink(path) if path is not None else ZmqLink(endpoint, context, random_id)


def open_async_link(
    endpoint: str, context: zmq.asyncio.Context, *, random_id: bool
) -> AsyncZmqLink | AsyncStreamLink:
    path = unix_path(endpoint)
    return AsyncStreamLink(path) if path is not None else AsyncZmqLink(endpoint, context, random_id)


def _broken(path: str, err: BaseException | None = None) -> ConnectionError:
    """The ConnectionError a ``unix://`` link raises once its connection is unusable
    (``err``: what broke it; None or an incomplete read: the sidecar closed it)."""
    if err is None or isinstance(err, asyncio.IncompleteReadError):
        return ConnectionError(f"the sidecar closed the connection at {path}")
    if isinstance(err, WorkerApiError):
        return ConnectionError(f"the sidecar at {path} sent a bad frame: {err.message}")
    return ConnectionError(f"the connection to {path} failed: {getattr(err, 'strerror', None) or err}")


def _ms(deadline: float) -> int:
    """Milliseconds left until ``deadline`` (at least 0), rounded up: never wake early."""
    return max(0, int((deadline - time.monotonic()) * 1000 + 0.999))


class _Dealer:
    """A DEALER; with ``random_id`` (authentication on) a fresh random routing id."""

    def __init__(self, endpoint: str, context: zmq.Context, random_id: bool) -> None:
        self.endpoint = endpoint
        self._context = context
        self._random_id = random_id
        self._connect()

    def _connect(self) -> None:
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self._random_id:
            self._socket.setsockopt(zmq.ROUTING_ID, new_routing_id())
        self._socket.connect(self.endpoint)

    def reset(self) -> None:
        """A new connection: nothing of the old one (a late answer) reaches the next call."""
        self.close()
        self._connect()

    def close(self) -> None:
        self._socket.close(linger=0)


class _Watched(_Dealer):
    """A DEALER whose monitor tells when a connection it had was dropped: the
    sidecar's end closed, as when its process ends. A sidecar that comes back at
    the same path is a new one, which knows none of this link's rooms, so a
    dropped link stays dropped until :meth:`reset`."""

    _poller_type: type = zmq.Poller

    def _connect(self) -> None:
        super()._connect()
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._dropped = False
        self._poller = self._poller_type()  # a frame or a monitor event, whichever comes
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def close(self) -> None:
        if not self._socket.closed:  # closing twice is harmless, as for the socket alone
            self._socket.disable_monitor()
        self._monitor.close(linger=0)
        super().close()

    def _note(self, frames: list[bytes]) -> None:
        self._dropped = self._dropped or parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED

    def _gone(self) -> ConnectionError:
        return ConnectionError(f"the sidecar closed the connection at {self.endpoint}")


class ZmqLink(_Watched):
    def prepare(self, deadline: float) -> bool:
        """Before a call: True when it runs on a new connection, as it does after the
        last one was dropped (otherwise ZeroMQ reconnects underneath)."""
        if self.alive():
            return False
        self.reset()
        return True

    def alive(self) -> bool:
        """False once the connection to the sidecar was dropped."""
        while not self._dropped:
            try:
                self._note(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        return not self._dropped

    def send(self, frame: bytes, deadline: float) -> bool | None:
        """True once the frame left, None when it could not before ``deadline``."""
        if not self._socket.poll(_ms(deadline), zmq.POLLOUT):
            return None
        self._socket.send(frame, zmq.NOBLOCK)
        return True

    def send_nowait(self, frame: bytes) -> None:
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def receive(self, deadline: float) -> bytes | None:
        """The next frame, or None when none came before ``deadline``; ConnectionError
        once the connection is dropped."""
        while True:
            ready = dict(self._poller.poll(_ms(deadline)))
            if self._socket in ready:
                return self._socket.recv_multipart(zmq.NOBLOCK)[-1]
            if self._monitor not in ready:
                return None
            if not self.alive():
                raise self._gone()


class StreamLink:
    def __init__(self, path: str) -> None:
        self.endpoint = f"unix://{path}"
        self.path = path
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self.absence = Absence(path)

    def _connected(self, deadline: float) -> socket.socket | None:
        while self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()  # not serving (yet): try again until the deadline, unless gone
                self.absence.check_refused()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                time.sleep(min(CONNECT_RETRY_S, left))
                continue
            except OSError as err:
                sock.close()
                raise ConnectionError(f"cannot connect to {self.path}: {err.strerror}") from None
            sock.setblocking(False)
            self._sock, self._buffer = sock, bytearray()
            self.absence.back()
        return self._sock

    def _ready(self, sock: socket.socket, event: int, deadline: float) -> bool:
        poller = select.poll()
        poller.register(sock, event)
        return bool(poller.poll(_ms(deadline)))

    def prepare(self, deadline: float) -> bool | None:
        """Before a call: forget a connection the sidecar closed while this worker was
        idle (it restarted, say), then connect. True: a new connection (authenticate
        again); None: none before ``deadline``. Nothing is sent yet, so nothing is lost."""
        if self._sock is not None and self._closed_by_peer(self._sock):
            self._lose()
        fresh = self._sock is None
        return None if self._connected(deadline) is None else fresh

    def alive(self) -> bool:
        """False once the sidecar closed this connection (late replies are kept)."""
        return self._sock is None or not self._closed_by_peer(self._sock)

    def _closed_by_peer(self, sock: socket.socket) -> bool:
        while self._ready(sock, select.POLLIN, 0.0):
            try:
                chunk = sock.recv(_RECV_NBYTES)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not chunk:
                return True
            self._buffer += chunk  # late replies: dropped by id later
        return False

    def send(self, frame: bytes, deadline: float) -> bool | None:
        sock = self._connected(deadline)
        if sock is None:
            return None
        data = memoryview(pack(frame))
        while data:
            try:
                data = data[sock.send(data) :]
            except BlockingIOError:
                if not self._ready(sock, select.POLLOUT, deadline):
                    self.reset()  # part of a frame left: the stream cannot carry another
                    return None
            except OSError as err:
                self._lose()
                raise _broken(self.path, err) from None
        return True

    def send_nowait(self, frame: bytes) -> None:
        if self._sock is not None:
            try:
                self._sock.send(pack(frame))
            except OSError:
                pass

    def receive(self, deadline: float) -> bytes | None:
        sock = self._connected(deadline)
        if sock is None:
            return None
        while True:
            frame = self._take()
            if frame is not None:
                return frame
            if not self._ready(sock, select.POLLIN, deadline):
                return None
            try:
                chunk = sock.recv(_RECV_NBYTES)
            except BlockingIOError:
                continue
            except OSError as err:
                self._lose()
                raise _broken(self.path, err) from None
            if not chunk:
                self._lose()
                raise _broken(self.path)
            self._buffer += chunk

    def _take(self) -> bytes | None:
        if len(self._buffer) < HEADER.size:
            return None
        try:
            nbytes = frame_length(bytes(self._buffer[: HEADER.size]))
        except WorkerApiError as err:
            self.reset()
            raise _broken(self.path, err) from None
        end = HEADER.size + nbytes
        if len(self._buffer) < end:
            return None
        frame = bytes(self._buffer[HEADER.size : end])
        del self._buffer[:end]
        return frame

    def _lose(self) -> None:
        self.absence.lost()
        self.reset()

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buffer = None, bytearray()

    def close(self) -> None:
        self.reset()


class AsyncZmqLink(_Watched):
    _poller_type = zmq.asyncio.Poller

    async def send(self, frame: bytes) -> None:
        if self._dropped:  # the next call after a drop runs on a new connection
            self.reset()
        await self._socket.send(frame)

    async def receive(self) -> bytes:
        """The next frame; ConnectionError once the link is closed or its connection dropped."""
        try:
            while True:
                ready = dict(await self._poller.poll())
                if self._socket in ready:
                    return (await self._socket.recv_multipart())[-1]
                if self._monitor in ready:
                    self._note(await self._monitor.recv_multipart())
                    if self._dropped:
                        raise self._gone()
        except zmq.ZMQError as err:
            raise ConnectionError(str(err)) from None


class AsyncStreamLink:
    def __init__(self, path: str) -> None:
        self.endpoint = f"unix://{path}"
        self.path = path
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._connecting: asyncio.Lock | None = None
        self.absence = Absence(path)

    async def _connected(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect if needed, trying again every 20 ms (the caller's timeout bounds it)."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            while self._streams is None:
                try:
                    self._streams = await asyncio.open_unix_connection(self.path)
                except (FileNotFoundError, ConnectionRefusedError):
                    self.absence.check_refused()  # not serving (yet), unless gone
                    await asyncio.sleep(CONNECT_RETRY_S)
                except OSError as err:
                    raise ConnectionError(f"cannot connect to {self.path}: {err.strerror}") from None
                else:
                    self.absence.back()
            return self._streams

    async def send(self, frame: bytes) -> None:
        streams = await self._connected()
        streams[1].write(pack(frame))
        try:
            await streams[1].drain()
        except OSError as err:
            self._drop(streams, lost=True)
            raise _broken(self.path, err) from None

    async def receive(self) -> bytes:
        streams = await self._connected()
        reader = streams[0]
        try:
            return await reader.readexactly(frame_length(await reader.readexactly(HEADER.size)))
        except (asyncio.IncompleteReadError, WorkerApiError, OSError) as err:
            self._drop(streams, lost=not isinstance(err, WorkerApiError))
            raise _broken(self.path, err) from None

    def _drop(self, streams, lost: bool = False) -> None:
        """Forget ``streams`` unless a newer connection replaced them already (``lost``: the
        sidecar closed them, or they broke)."""
        if lost:
            self.absence.lost()
        try:
            streams[1].close()
        except RuntimeError:  # closed after its event loop: the socket goes with the transport
            pass
        if self._streams is streams:
            self._streams = None

    def reset(self) -> None:
        if self._streams is not None:
            self._drop(self._streams)

    def close(self) -> None:
        self.reset()
