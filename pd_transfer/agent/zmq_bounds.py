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
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pd_transfer.errors import Reason
from pd_transfer.wire.limits import DEFAULT_LIMITS

log = logging.getLogger(__name__)

#: the largest frame a peer may send on a control or bootstrap socket
CONTROL_FRAME_NBYTES = DEFAULT_LIMITS.max_frame_nbytes
#: frames ZeroMQ may queue for one connection before the sidecar reads them (RCVHWM;
#: ZeroMQ's default is 1,000): with the frame cap, at most 4 x 16 MiB per peer connection.
#: Past it ZeroMQ stops reading that connection, and TCP pushes back on the sender.
CONTROL_QUEUED_FRAMES = 4

#: monitor events read at once before the loop serves anything else
_DRAINED = 256

_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def bound_frames(
    socket: zmq.Socket,
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


class ConnectionWatch:
    """Counts the ends of one listening socket's connections; :meth:`run` is its task.

    ``on_closed(socket_name)`` for every connection that ended (and
    ``on_disconnected(fd)`` with its file descriptor, for an owner that tells
    connections apart; ``on_accepted(fd)`` for every connection accepted),
    ``on_bad_frame(reason)`` for a failed ZeroMQ handshake (not ZMTP on the port).
    """

    def __init__(
        self,
        socket: zmq.asyncio.Socket,
        name: str,
        where: str,
        *,
        on_closed: Callable[[str], None] = lambda name: None,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_disconnected: Callable[[int], None] = lambda fd: None,
        on_accepted: Callable[[int], None] = lambda fd: None,
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

    async def run(self) -> None:
        monitor = self._monitor
        try:
            while True:
                events = [await monitor.recv_multipart()]
                while len(events) < _DRAINED:  # a burst's events at once: its strangers cut sooner
                    try:
                        events.append(await monitor.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                for frames in events:
                    if not self._handle(parse_monitor_message(frames)):
                        return
        except zmq.ZMQError as err:  # the socket closed under the monitor
            log.debug("%s: connection watch stopped: %s", self.where, err)
        finally:
            monitor.close(linger=0)

    def _handle(self, message: dict) -> bool:
        """One monitor event; False once the monitor stopped."""
        event = message["event"]
        if event == zmq.EVENT_MONITOR_STOPPED:
            return False
        if event == zmq.EVENT_ACCEPTED:
            self._on_accepted(int(message["value"]))
        elif event == zmq.EVENT_DISCONNECTED:
            self.closed += 1
            self._on_closed(self.name)
            self._on_disconnected(int(message["value"]))
            log.debug(  # every departing peer ends one: routine, so not at info
                "%s: a connection ended (%d so far): the peer left, or sent a "
                "frame over the %d-byte limit or one ZeroMQ could not parse",
                self.where,
                self.closed,
                self._limit,
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._on_bad_frame(Reason.BAD_FRAME.value)
            log.warning(
                "%s: dropped a connection that is not ZeroMQ (its handshake broke the protocol)",
                self.where,
            )
        return True


def _monitor_socket(socket: zmq.Socket) -> zmq.Socket:
    """``socket``'s monitor, read by the watch, holding as few events unread as ZeroMQ
    allows. ZeroMQ's I/O thread waits when the watch has not read them: it accepts at most
    that many connections (about 1,000, the monitor's own queue) before the lobby hears of
    them, instead of twice as many with the default queue on the reading side too."""
    address = f"inproc://pd-transfer.watch-{next(_monitors)}"
    socket.monitor(address, _WATCHED)
    monitor = socket.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 1)
    monitor.connect(address)
    return monitor


_monitors = itertools.count()
