"""A ROUTER's shape on a plain Unix stream socket: the ``unix://`` worker endpoint.

ZeroMQ hands every message to an I/O thread on each side, so one worker call
over ``ipc://`` wakes four threads; on a small VM that is most of a one-page
room's latency (a round trip after 50 ms idle: about 0.53 ms over ZeroMQ
``ipc://``, 0.18 ms over a Unix socket; warm, 0.17 ms against 0.02 ms). A
``unix://PATH`` endpoint serves the same worker API frames, each with a
length header (:mod:`pd_transfer.protocol.stream_frames`), on a socket the
event loop reads itself.

:class:`StreamRouter` offers what :class:`~pd_transfer.agent.worker_endpoint.WorkerEndpoint`
uses of a ROUTER: ``recv_multipart`` gives ``[identity, frame]``, where the
identity is a random id given to the connection, and ``send_multipart``
answers on that connection (dropped once it is gone, as a ROUTER drops it).

Bounds: frames waiting for the endpoint are at most ``max_queued``; past that
the connections stop being read and their workers' sends block in the
kernel. A header announcing more than a worker frame may hold closes the
connection after an error reply. A worker that stops reading its replies
while more than ``max_unread_nbytes`` pile up is disconnected.

Before a connection authenticated (``authenticated(identity)``, the
endpoint's handshake gate; always true with authentication off) it is a
stranger's, and holds little: a frame of at most
:data:`PRE_AUTH_FRAME_NBYTES` (the handshake's frames are at most 2 KiB), one
deadline from the accept for the whole handshake (``handshake_timeout_s``),
and at most ``max_pending`` such connections, the oldest cut off for a newer
one. Each cut-off is answered where it can be, counted as a bad frame
(``frame_too_large``, ``timeout``, ``limit_exceeded``) and logged. A
connection that ends inside a large frame hands the freed memory back to the
system (:func:`return_freed_memory`).

The socket file is created with mode 0600: only the sidecar's user (and
root) may connect. A path where another process still serves is refused (an
OSError, exit code 3 for ``serve``); a stale socket file left by a crash is
replaced; any other file there is left alone and refused.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import socket
import stat
from collections.abc import Callable

from pd_transfer.errors import Reason
from pd_transfer.protocol import worker_api
from pd_transfer.protocol.stream_frames import HEADER, frame_length, pack
from pd_transfer.protocol.worker_api import WorkerApiError
from pd_transfer.security import new_routing_id

log = logging.getLogger(__name__)

MAX_QUEUED = 1024
MAX_UNREAD_NBYTES = 64 * 1024 * 1024
#: the largest frame of a connection that has not authenticated: a handshake frame
#: (at most 2 KiB) or a request refused unread with ``unauthenticated``
PRE_AUTH_FRAME_NBYTES = 4096
#: connections waiting for their handshake; one more cuts the oldest off
MAX_PENDING = 64
#: a connection that ends inside a frame this large returns the freed memory (glibc
#: keeps freed heap pages for reuse: 731 MiB of 16 closed 60 MiB partial frames stayed)
_TRIM_NBYTES = 1 << 20


class StreamRouter:
    def __init__(
        self,
        path: str,
        *,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_closed: Callable[[bytes], None] = lambda identity: None,
        max_queued: int = MAX_QUEUED,
        max_unread_nbytes: int = MAX_UNREAD_NBYTES,
        authenticated: Callable[[bytes], bool] = lambda identity: True,
        handshake_timeout_s: float = 10.0,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.path = path
        self._on_bad_frame = on_bad_frame
        self._on_closed = on_closed
        self._max_unread_nbytes = max_unread_nbytes
        self._authenticated = authenticated
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending = max_pending
        self._pending: dict[bytes, asyncio.TimerHandle] = {}  # not authenticated yet, oldest first
        self._listener = listen_unix(path)
        self._inbox: asyncio.Queue[list[bytes]] = asyncio.Queue(max_queued)
        self._writers: dict[bytes, asyncio.StreamWriter] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve_connection, sock=self._listener)

    async def recv_multipart(self) -> list[bytes]:
        return await self._inbox.get()

    async def send_multipart(self, frames: list[bytes]) -> None:
        identity, frame = frames
        writer = self._writers.get(identity)
        if writer is None or writer.is_closing():
            return
        writer.write(pack(frame))
        if writer.transport.get_write_buffer_size() > self._max_unread_nbytes:
            log.warning(
                "worker endpoint %s: a worker left more than %d bytes of replies unread; disconnecting it",
                self.path,
                self._max_unread_nbytes,
            )
            writer.transport.abort()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        identity = new_routing_id()
        self._writers[identity] = writer
        if not self._authenticated(identity):
            self._admit_stranger(identity)
        nbytes = 0
        try:
            while True:
                nbytes = frame_length(await reader.readexactly(HEADER.size))
                if nbytes > PRE_AUTH_FRAME_NBYTES and not self._trusted(identity):
                    raise WorkerApiError(
                        f"a frame header announces {nbytes} bytes before the connection "
                        f"authenticated; at most {PRE_AUTH_FRAME_NBYTES} are read until then",
                        code=Reason.FRAME_TOO_LARGE,
                    )
                await self._inbox.put([identity, await reader.readexactly(nbytes)])
                nbytes = 0
        except WorkerApiError as err:
            self._on_bad_frame(err.code.value)
            log.warning("worker endpoint %s: %s", self.path, err.message)
            writer.write(pack(worker_api.error_reply(-1, err)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker closed its end (between frames or inside one), or was cut off
        finally:
            del self._writers[identity]
            self._forget_stranger(identity)
            writer.close()
            self._on_closed(identity)
            if nbytes >= _TRIM_NBYTES:
                return_freed_memory()

    # -- strangers: connections that have not authenticated --------------------------------
    def _trusted(self, identity: bytes) -> bool:
        """Whether ``identity`` authenticated (it then leaves the pending connections)."""
        if identity in self._pending and self._authenticated(identity):
            self._pending.pop(identity).cancel()
        return identity not in self._pending

    def _admit_stranger(self, identity: bytes) -> None:
        """Arm its deadline; at ``max_pending`` strangers, cut the oldest off."""
        pending = [i for i in list(self._pending) if not self._trusted(i)]
        for oldest in pending[: max(0, len(pending) - self._max_pending + 1)]:
            self._cut_off(
                oldest,
                Reason.LIMIT_EXCEEDED,
                f"{self._max_pending} connections are waiting for their authentication "
                f"handshake: this one, the oldest, makes room for a newer one",
            )
        timeout_s = self._handshake_timeout_s
        self._pending[identity] = asyncio.get_running_loop().call_later(
            timeout_s,
            self._cut_off,
            identity,
            Reason.TIMEOUT,
            f"no authentication handshake within {timeout_s:g} s of the connection",
        )

    def _cut_off(self, identity: bytes, code: Reason, why: str) -> None:
        """End a connection that has not authenticated (no-op once it has)."""
        writer = self._writers.get(identity)
        if writer is None or self._trusted(identity):
            return
        self._pending.pop(identity).cancel()
        self._on_bad_frame(code.value)
        log.warning("worker endpoint %s: %s; closing it", self.path, why)
        writer.transport.abort()  # its reader sees the end, whatever it was reading

    def _forget_stranger(self, identity: bytes) -> None:
        handle = self._pending.pop(identity, None)
        if handle is not None:
            handle.cancel()

    def is_open(self, identity: bytes) -> bool:
        """Whether the connection ``identity`` names is still open."""
        return identity in self._writers

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers.values()):
            writer.transport.abort()
        for handle in self._pending.values():
            handle.cancel()
        self._listener.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except OSError:
            pass


def return_freed_memory() -> None:
    """Hand the heap pages freed since to the system (glibc's ``malloc_trim``; elsewhere a
    no-op): a large frame grows through many reallocations, and glibc keeps such freed
    pages for reuse instead of returning them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def listen_unix(path: str) -> socket.socket:
    """A listening Unix stream socket at ``path``, mode 0600 (see the module docstring)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket; refusing to replace it")
        if _answers(path):
            raise OSError(errno.EADDRINUSE, f"another process serves the worker endpoint {path}")
        os.unlink(path)  # a stale socket file: nobody listens on it any more
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chmod(path, 0o600)  # before listen(): until then no one can connect
        listener.listen(128)
        listener.setblocking(False)
    except OSError as err:
        listener.close()
        raise OSError(err.errno, f"cannot listen on {path}: {err.strerror}") from None
    return listener


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True
