"""A receiver that serves plain sockets, one thread per connection.

The tcp data receiver (:mod:`~pd_transfer.transport.tcp.receiver`) and the
engines' staging channel (:mod:`~pd_transfer.transport.engines.staging.receiver`)
accept connections the same way, and :class:`ThreadedReceiver` is that way,
stated once: a listening socket accepted on the event loop, each connection
served by its own thread (blocking socket I/O and numpy scatters release the
GIL; see :mod:`~pd_transfer.transport.tcp.transport`), the handshake gate of
:mod:`~pd_transfer.transport.tcp.handshake_gate` when ``auth`` is set, caps on
pending and authenticated connections, and one count of what was refused
(:class:`ReceiverStats`). A subclass says what a connection is
(:meth:`ThreadedReceiver._connection`) and how it fences.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Receiver
from pd_transfer.transport.receiver_rooms import ReceiverRooms, RoomPolicy
from pd_transfer.transport.tcp.handshake_gate import GatedConnection, arm_deadline, make_room
from pd_transfer.transport.tcp.sockets import Authenticator, configure, format_address, stop_serving


@dataclass
class ReceiverStats:
    chunks_landed: int = 0
    nbytes_landed: int = 0
    transfers_done: int = 0
    refused: Counter = field(default_factory=Counter)  # Reason -> frames refused

    @property
    def frames_refused(self) -> int:
        return sum(self.refused.values())


class ThreadedReceiver(Receiver):
    """Accepts at ``tcp://bind_host:port`` and serves each connection in a thread.

    ``on_bad_frame(reason)`` is called from connection threads for every frame
    or connection refused for breaking the stream; ``on_closed()`` on the
    event loop for every connection that ended.
    """

    label: ClassVar[str]  # "tcp receiver": names it in logs and errors
    thread_prefix: ClassVar[str]  # connection threads' names: "pdt-tcp-recv-<port>"
    task_prefix: ClassVar[str]  # the accept task's name: "tcp-receiver-<address>"
    log: ClassVar[logging.Logger]

    def __init__(
        self,
        bind_host: str,
        port: int,
        *,
        auth: Authenticator | None,
        handshake_timeout_s: float,
        max_connections: int,
        max_pending: int,
        on_bad_frame: Callable[[str], None],
        on_closed: Callable[[], None] = lambda: None,
        policy: RoomPolicy = RoomPolicy.ANY,
        admission: ReceiverRooms | None = None,
    ) -> None:
        super().__init__(policy, admission)
        self.bind_host, self.port = bind_host, port
        self.auth = auth
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_pending = max_pending
        self.on_bad_frame = on_bad_frame  # called from connection threads
        self.on_closed = on_closed  # a connection ended (called on the event loop)
        self._authenticated = 0  # connections past the handshake (under _stats_lock)
        self.stats = ReceiverStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: dict[GatedConnection, threading.Thread] = {}
        self._stats_lock = threading.Lock()

    @abstractmethod
    def _connection(self, sock: socket.socket, where: str) -> GatedConnection:
        """A connection of this receiver's kind; its ``serve()`` is its thread's body."""

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and start serving; return the address peers connect to."""
        self.loop = asyncio.get_running_loop()
        try:
            listener = socket.create_server(
                (self.bind_host, self.port),
                backlog=128,
                family=socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET,
            )
        except OSError as err:
            raise TransportError(
                f"{self.label} cannot bind {self.bind_host}:{self.port}: {err}", code=Reason.TRANSPORT_FAILED
            ) from None
        listener.setblocking(False)
        self._listener = listener
        self.address = format_address(self.bind_host, listener.getsockname()[1])
        self._accepting = asyncio.create_task(
            self._accept(listener), name=f"{self.task_prefix}-{self.address}"
        )
        return self.address

    async def stop(self) -> None:
        await stop_serving(self)

    # -- for the connections (their threads) ---------------------------------------------
    def count(self, code: Reason) -> None:
        with self._stats_lock:
            self.stats.refused[code] += 1

    def bad_frame(self, code: Reason, why: str, where: str, *, logged: bool = True) -> None:
        """A frame (or connection) refused for breaking the stream or the handshake rules:
        counted, reported, logged (the log filter rate-limits repeats of one line, per reason)."""
        self.count(code)
        self.on_bad_frame(code.value)
        if logged:
            self.log.warning(
                "%s %s: closing %s [%s]: %s",
                self.label,
                self.address,
                where,
                code.value,
                why,
                extra={"reason": code.value},
            )

    def admit_authenticated(self, connection: GatedConnection) -> bool:
        """Take an authenticated connection's slot; False (it is refused) when all are held."""
        with self._stats_lock:
            full = self._authenticated >= self.max_connections
            if not full:
                self._authenticated += 1
                connection.holds_slot = True
        if full:
            self.bad_frame(
                Reason.LIMIT_EXCEEDED,
                f"{self.max_connections} authenticated connections already (max_connections)",
                connection.where,
            )
        return not full

    def landed(self, nbytes: int) -> None:
        with self._stats_lock:
            self.stats.chunks_landed += 1
            self.stats.nbytes_landed += nbytes

    def transfer_done(self) -> None:
        with self._stats_lock:
            self.stats.transfers_done += 1

    # -- accepting ----------------------------------------------------------------------
    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as err:  # e.g. out of descriptors: keep serving the others
                self.log.warning("%s %s: accept failed: %s", self.label, self.address, err)
                await asyncio.sleep(0.1)
                continue
            where = f"peer {peer[0]}:{peer[1]}"
            if self.auth is None and len(self._connections) >= self.max_connections:
                self.bad_frame(
                    Reason.LIMIT_EXCEEDED,
                    f"{len(self._connections)} connections already (max_connections)",
                    where,
                )
                sock.close()
                continue
            if self.auth is not None:
                make_room(self._connections, self.max_pending)
            sock.setblocking(True)
            configure(sock)
            connection = self._connection(sock, where)
            thread = threading.Thread(
                target=self._serve, args=(connection,), daemon=True, name=f"{self.thread_prefix}-{peer[1]}"
            )
            self._connections[connection] = thread
            if self.auth is not None:
                arm_deadline(loop, connection, self.handshake_timeout_s)
            thread.start()

    def _ended(self, connection: GatedConnection) -> None:
        self._connections.pop(connection, None)
        self.on_closed()

    def _serve(self, connection: GatedConnection) -> None:
        try:
            connection.serve()
        finally:
            if connection.holds_slot:
                with self._stats_lock:
                    self._authenticated -= 1
            try:
                if self.loop is not None:  # set by start(), before any connection
                    self.loop.call_soon_threadsafe(self._ended, connection)
            except RuntimeError:
                pass  # the loop is gone
