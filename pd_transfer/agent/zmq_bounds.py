"""Frame caps on the sidecar's ZeroMQ sockets, and a watch on their connections.

ZeroMQ reads a whole frame into memory before the application sees it: without
a cap, a stranger who declares an 8 GiB frame on the control or bootstrap port
makes the sidecar hold everything it sends, before the codec's frame limit or
the authentication handshake runs. :func:`bound_frames` sets ``MAXMSGSIZE`` on
a socket from the one frame limit of the protocol
(:data:`~pd_transfer.wire.limits.DEFAULT_LIMITS`, 16 MiB; the worker API
and the data plane pass their own), so ZeroMQ drops the connection as soon as
a frame header declares more, having buffered nothing of it. Frames under the
cap are bounded in number instead: ZeroMQ queues at most
:data:`CONTROL_QUEUED_FRAMES` of one connection's frames before the sidecar
reads them on a listening socket (control, bootstrap), so even a peer holding
the secret cannot make a sidecar hold more than that many frames' worth of
its bytes.

ZeroMQ drops such a connection without telling the application why. The
:class:`ConnectionWatch` of a listening socket follows its monitor and counts
every connection that ends (``pd_transfer_connections_closed_total{socket}``:
a peer leaving, and a peer dropped for an oversized or malformed frame, end a
connection alike), and every connection whose ZeroMQ handshake failed on a
protocol error (something that is not ZeroMQ on the port) as a bad frame.
It also names the connection that ended (``on_disconnected(fd)``): the
control ROUTER marks the session whose frames came on it as down
(agent/channels.py). :meth:`ConnectionWatch.drain` handles the events already
queued, so that the ROUTER attributes a frame only after every event ZeroMQ
queued before it: a descriptor reused by a new connection is then never
mistaken for the one that ended.

:func:`watch_peers` has the kernel watch the control connections: TCP
keepalive probes an idle connection every second, and ``TCP_USER_TIMEOUT``
closes a connection whose data or probes go unacknowledged for
``peer_connection_timeout_s``. The peer's kernel answers, not its Python loop
nor even its process: a peer starved of CPU, or stopped, keeps its
connection, while a peer whose host vanished (no FIN, no RST) loses it. So a
connection that is up says the peer's process is there, however late its own
heartbeats (agent/liveness.py); a process that dies closes it at once.
ZeroMQ's own heartbeats (ZMTP PING/PONG) would also see a stopped process,
but libzmq 4.3 aborts the process on an assertion (``!_io_error``,
stream_engine_base.cpp) when a heartbeating connection whose received frames
wait unread (the :data:`CONTROL_QUEUED_FRAMES` of a listening socket) is hung
up by its peer: a starved prefill whose decode peer dies. They stay off.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_transfer.errors import Reason
from pd_transfer.wire.limits import DEFAULT_LIMITS

if TYPE_CHECKING:
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger(__name__)
ContextT = TypeVar("ContextT", bound=zmq.Context[zmq.Socket[object]])

#: the largest frame a peer may send on a control or bootstrap socket
CONTROL_FRAME_NBYTES = DEFAULT_LIMITS.max_frame_nbytes
#: frames ZeroMQ may queue for one connection before the sidecar reads them (RCVHWM;
#: ZeroMQ's default is 1,000): with the frame cap, at most 4 x 16 MiB per peer connection.
#: Past it ZeroMQ stops reading that connection, and TCP pushes back on the sender.
CONTROL_QUEUED_FRAMES = 4

_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def bound_frames(
    socket: zmq.Socket[object],
    max_frame_nbytes: int = CONTROL_FRAME_NBYTES,
    queued_frames: int | None = None,
    handshake_timeout_s: float | None = None,
) -> None:
    """ZeroMQ drops a connection whose next frame declares more than ``max_frame_nbytes``,
    and queues at most ``queued_frames`` received frames per connection (None: ZeroMQ's
    default; a listening socket passes :data:`CONTROL_QUEUED_FRAMES`; a connecting
    one keeps the default: a ROUTER drops what its peer's full queue cannot take, so
    the sockets that connect to a prefill keep room for its replies), and ends a
    connection whose ZeroMQ handshake takes over ``handshake_timeout_s``. Set before
    the socket binds or connects."""
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_nbytes)
    if queued_frames is not None:
        socket.setsockopt(zmq.RCVHWM, queued_frames)
    if handshake_timeout_s is not None:  # ZeroMQ's own handshake (ZMTP, CURVE); default 30 s
        socket.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_timeout_s * 1000)))


@dataclass(frozen=True)
class PeerKeepalive:
    """The kernel's watch on a peer connection: ``timeout_s`` without an acknowledgement
    (of data, or of keepalive probes sent each second once it is idle) closes it."""

    timeout_s: float


def watching_peers(context: ContextT, config: SidecarConfig) -> ContextT:
    """``context`` (the sidecar's), naming the keepalive its control sockets run."""
    context.peer_keepalive = PeerKeepalive(config.peer_connection_timeout_s)
    return context


def watch_peers(socket: zmq.Socket[object], context: zmq.Context[zmq.Socket[object]]) -> PeerKeepalive | None:
    """Turn on for ``socket`` the keepalive the sidecar's ``context`` names for its control
    sockets (its ``peer_keepalive``); it, or None. Set before the socket binds or connects."""
    keepalive: PeerKeepalive | None = getattr(context, "peer_keepalive", None)
    if keepalive is None:
        return None
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)  # seconds idle before the first probe
    socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, max(1, math.ceil(keepalive.timeout_s)))
    socket.setsockopt(zmq.TCP_MAXRT, max(1, int(keepalive.timeout_s * 1000)))  # TCP_USER_TIMEOUT
    return keepalive


class ConnectionWatch:
    """Counts the ends of one listening socket's connections; :meth:`run` is its task.

    ``on_closed(socket_name)`` for every connection that ended (and
    ``on_disconnected(fd)`` with its file descriptor, for an owner that tells
    connections apart; ``on_accepted(fd)`` for every connection accepted),
    ``on_bad_frame(reason)`` for a failed ZeroMQ handshake (not ZMTP on the port).
    The events are read in order by :meth:`run` and by whoever calls :meth:`drain`.
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        name: str,
        where: str,
        *,
        on_closed: Callable[[str], None] = lambda name: None,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_disconnected: Callable[[int], object] = lambda fd: None,
        on_accepted: Callable[[int], object] = lambda fd: None,
    ) -> None:
        self.name = name
        self.where = where
        self.closed = 0
        self._on_closed = on_closed
        self._on_disconnected = on_disconnected
        self._on_accepted = on_accepted
        self._on_bad_frame = on_bad_frame
        self._limit = socket.getsockopt(zmq.MAXMSGSIZE)  # -1: none
        self._monitor = _monitor_socket(socket)
        # reads it without waiting
        self._reader: zmq.Socket[bytes] = zmq.Socket.shadow(self._monitor.underlying)
        self._stopped = False

    async def run(self) -> None:
        monitor = self._monitor
        try:
            while not self._stopped:
                await monitor.poll()
                self.drain()
        except zmq.ZMQError as err:  # the socket closed under the monitor
            log.debug("%s: connection watch stopped: %s", self.where, err)
        finally:
            self._stopped = True
            monitor.close(linger=0)

    def drain(self) -> None:
        """Handle every event queued so far (without waiting for more)."""
        while not self._stopped:
            if self._monitor.closed:  # closed under the watch (its context destroyed): the
                self._stopped = True  # shadow's handle is freed memory, never to be read
                return
            try:
                message = parse_monitor_message(self._reader.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError as err:  # closed: run() ends at its next poll
                log.debug("%s: connection watch stopped: %s", self.where, err)
                self._stopped = True
                return
            self._handle(message["event"], int(message["value"]))

    def _handle(self, event: int, value: int) -> None:
        if event == zmq.EVENT_MONITOR_STOPPED:
            self._stopped = True
        elif event == zmq.EVENT_ACCEPTED:
            self._on_accepted(value)
        elif event == zmq.EVENT_DISCONNECTED:
            self.closed += 1
            self._on_closed(self.name)
            self._on_disconnected(value)
            log.debug(  # every departing peer ends one: routine, so not at info
                "%s: a connection ended (%d so far): the peer left or its host stopped "
                "answering, or it sent a frame over the %d-byte limit or one ZeroMQ could "
                "not parse",
                self.where,
                self.closed,
                self._limit,
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._on_bad_frame(Reason.BAD_FRAME.value)
            log.warning(
                "%s: dropped a connection that is not ZeroMQ (its handshake broke the protocol)", self.where
            )


def _monitor_socket(socket: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
    """``socket``'s monitor, read by the watch, holding as few events unread as ZeroMQ
    allows. ZeroMQ's I/O thread waits when the watch has not read them: it accepts at most
    that many connections (about 1,000, the monitor's own queue) before the lobby hears of
    them, instead of twice as many with the default queue on the reading side too."""
    address = f"inproc://pd-transfer.watch-{next(_monitors)}"
    socket.monitor(address, _WATCHED)
    monitor: zmq.asyncio.Socket = socket.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 1)
    monitor.connect(address)
    return monitor


_monitors = itertools.count()
