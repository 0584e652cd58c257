"""Strangers on the ZeroMQ listening ports: how many, for how long, how many bytes.

A connection to the control, bootstrap or ZeroMQ worker port is a *stranger's* from its
accept until it proves the shared secret (:mod:`pd_transfer.agent.auth`).
ZeroMQ accepts and buffers for the application, so without a bound a few
thousand idle connections exhaust the sidecar's file descriptors (its own
health port and peers then fail with ``EMFILE``), and a few dozen partial
frames under the 16 MiB cap hold a gigabyte. The :class:`Lobby` bounds them,
per port (a :class:`Door`) and in total:

- **how many**: at most ``max_pending`` strangers per port and
  ``max_total`` over all ports. One more evicts the oldest stranger that has
  not started the handshake (a real peer does so at once: evicting the
  oldest idle one leaves a newer one the time of its round trip); when every one has (an ``AuthHello`` flood),
  it evicts the oldest of the address holding the most strangers, if that
  address holds more than the newcomer's, and otherwise the newcomer is
  refused: a flood cannot cut a real peer off between its hello and its
  proof, and one host's flood leaves room for the peers of another;
- **how long**: one deadline from the accept for the whole handshake
  (``timeout_s``; ZeroMQ's own handshake is bounded by ``HANDSHAKE_IVL``
  set to the same value, see :func:`pd_transfer.agent.zmq_bounds.bound_frames`);
- **how many bytes**: a stranger that has sent more than ``max_nbytes``
  (the kernel's count, ``TCP_INFO``: none on ``ipc://``) is dropped at the next check,
  every :data:`CHECK_INTERVAL_S`; handshake frames are at most 2 KiB. Once ZeroMQ
  reports a cut stranger gone, the heap pages its frames held go back to the system;
- **file descriptors in reserve**: a stranger accepted on a descriptor
  within ``fd_reserve`` of the soft ``RLIMIT_NOFILE`` is refused at once
  (descriptors are allocated lowest first, so such a number means that many
  are open), keeping room for authenticated peers, the worker and the
  health port. :func:`~pd_transfer.agent.descriptors.raise_fd_limit` lifts the soft limit to the hard one
  at start.

A refused handshake ends the connection too: after its reply has had
:data:`~pd_transfer.agent.auth.REFUSAL_LINGER_MS` to leave, it is cut, and
frames it sends meanwhile are dropped unanswered.

Connections are told apart by file descriptor: ZeroMQ's monitor reports each
accept and disconnect with it, and every received frame carries it
(``SRCFD``). The lobby ends a connection with ``shutdown(2)`` on that
descriptor (ZeroMQ then closes it and reports the disconnect), after checking
it still joins the same two addresses as at the accept, so a descriptor
number reused by another connection is never touched. Every refusal is
counted (``on_refused(socket, reason)``,
``pd_transfer_connections_refused_total{socket,reason}``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from pd_transfer.agent.descriptors import fd_reserve_for
from pd_transfer.agent.stream_router import return_freed_memory

log = logging.getLogger(__name__)

#: how often strangers' received bytes are checked while any are connected
CHECK_INTERVAL_S = 0.05
#: after a stranger's connection ended, when the heap pages its frames held go back
TRIM_DELAY_S = 0.1
#: what a stranger may send before it authenticates: the ZMTP and CURVE
#: handshakes and three handshake frames of at most 2 KiB take under 4 KiB
STRANGER_NBYTES = 256 * 1024

#: ended strangers' descriptors remembered, for frames read after their end (Door.ended)
_ENDED_KEPT = 256
_TCP_INFO_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in struct tcp_info (Linux >= 4.1)


def _ends(sock: socket.socket) -> tuple[object, object]:
    return sock.getsockname(), sock.getpeername()


def _bytes_received(sock: socket.socket) -> int | None:
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES_RECEIVED + 8)
    except OSError:
        return None  # not TCP (ipc://)
    if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
        return None
    return int(struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)[0])


@dataclass(eq=False)
class Stranger:
    """One unauthenticated connection of a door."""

    door: Door
    fd: int
    ends: tuple[object, object]  # (local, peer) addresses at the accept
    since_s: float
    hello: bool = False  # it started the handshake (its AuthHello was answered)
    refused: bool = False  # its handshake was refused: cut after the reply leaves
    timer: asyncio.TimerHandle | None = None

    @property
    def host(self) -> str:
        """The peer's address, without its port."""
        return str(self.ends[1][0]) if isinstance(self.ends[1], tuple) else str(self.ends[1])

    def probe(self, what: Callable[[socket.socket], object]) -> object | None:
        """``what(sock)`` on this connection's descriptor, None if it is no longer this
        connection (closed, or the number reused by another)."""
        try:
            sock = socket.socket(fileno=self.fd)
        except OSError:
            return None
        try:
            return what(sock) if _ends(sock) == self.ends else None
        except OSError:
            return None
        finally:
            sock.detach()


class Lobby:
    """The sidecar's strangers over all its ZeroMQ listening ports."""

    def __init__(
        self,
        *,
        max_pending: int = 32,
        max_total: int = 64,
        timeout_s: float = 10.0,
        max_nbytes: int = STRANGER_NBYTES,
        fd_limit: int | None = None,
    ) -> None:
        self.max_pending, self.max_total = max_pending, max_total
        self.timeout_s = timeout_s
        self.max_nbytes = max_nbytes
        limit = fd_limit or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.fd_ceiling = limit - fd_reserve_for(limit)  # strangers get descriptors below it
        self.doors: list[Door] = []
        self.refused: dict[tuple[str, str], int] = {}  # (socket, reason) -> connections ended
        self.on_refused: Callable[[str, str], None] = lambda socket, reason: None
        self._checking: asyncio.Task[None] | None = None
        self._trim: asyncio.TimerHandle | None = None

    def door(
        self,
        name: str,
        *,
        active: bool = True,
        max_pending: int | None = None,
        timeout_s: float | None = None,
        local: bool = False,
    ) -> Door:
        """The strangers of one listening socket, named ``name`` in logs and metrics.
        Not ``active`` (authentication off: nobody is told apart), it bounds nothing.
        ``max_pending`` and ``timeout_s`` default to the lobby's. A ``local`` door (the
        worker endpoint) is its own: its strangers count neither towards ``max_total``
        nor against the other doors', and the descriptor reserve, kept for the worker
        among others, does not apply to it (its own cap bounds what it holds)."""
        door = Door(self, name, self.max_pending if max_pending is None else max_pending, active=active)
        door.timeout_s = self.timeout_s if timeout_s is None else timeout_s
        door.local = local
        if active:
            self.doors.append(door)
        return door

    @property
    def num_strangers(self) -> int:
        """Strangers under ``max_total``: those of every door but the local ones."""
        return sum(len(door.strangers) for door in self.doors if not door.local)

    def _victim(self, doors: list[Door], newcomer: Stranger) -> Stranger | None:
        """Whom ``newcomer`` evicts: the oldest idle stranger; with none idle, when one
        address holds more strangers than the newcomer's does, that address's oldest
        (one host's flood does not lock out another's peers); else nobody."""
        live = [s for door in doors if door.local == newcomer.door.local for s in door.strangers.values()]
        live = [s for s in live if not s.refused]
        idle = [s for s in live if not s.hello]
        if idle:
            return min(idle, key=lambda s: s.since_s)
        held: dict[str, list[Stranger]] = {}
        for stranger in live:
            held.setdefault(stranger.host, []).append(stranger)
        if not held:
            return None
        most = max(held.values(), key=len)
        if len(most) <= len(held.get(newcomer.host, ())) + 1:
            return None
        return min(most, key=lambda s: s.since_s)

    def _count(self, name: str, reason: str) -> None:
        self.refused[(name, reason)] = self.refused.get((name, reason), 0) + 1
        self.on_refused(name, reason)

    def _check_soon(self) -> None:
        if self._checking is None or self._checking.done():
            self._checking = asyncio.get_running_loop().create_task(self._check_bytes())

    def _trim_soon(self) -> None:
        """Hand the memory strangers' frames held back to the system, once their
        connections are gone (ZeroMQ frees it on its own thread, then reports)."""
        if self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        return_freed_memory()

    async def _check_bytes(self) -> None:
        """While strangers are connected: drop any that sent more than ``max_nbytes``."""
        while any(door.strangers for door in self.doors):
            await asyncio.sleep(CHECK_INTERVAL_S)
            for door in list(self.doors):
                for stranger in list(door.strangers.values()):
                    received = stranger.probe(_bytes_received)
                    if isinstance(received, int) and received > self.max_nbytes:
                        door.cut(stranger, "nbytes", f"sent {received} bytes before authenticating")


class Door:
    """One listening socket's strangers; its owner reports accepts, frames and ends."""

    def __init__(self, lobby: Lobby, name: str, max_pending: int, *, active: bool = True) -> None:
        self.lobby = lobby
        self.active = active
        self.name = name
        self.max_pending = max_pending
        self.timeout_s = lobby.timeout_s  # the handshake deadline (Lobby.door sets it)
        self.local = False  # see Lobby.door
        # the listening address, as getsockname() gives it (bound()): a port, or a socket path
        self.address: int | str | None = None
        self.strangers: dict[int, Stranger] = {}  # fd -> stranger
        self.members: set[int] = set()  # fds past the handshake
        self.on_gone: Callable[[int], None] = lambda fd: None  # a connection ended
        self._cut: set[int] = set()  # strangers' fds cut, until ZeroMQ reports them gone
        self._ended: dict[int, None] = {}  # the latest strangers' fds whose connection ended

    # -- what the socket's owner reports -------------------------------------------
    def accepted(self, fd: int) -> Stranger | None:
        """A connection was accepted on ``fd``: a stranger, unless there is no room."""
        if not self.active:
            return None
        if fd in self.strangers or fd in self.members:
            return self.strangers.get(fd)  # its frames were read before the accept event
        stranger = self._record(fd)
        if stranger is None:
            return None  # gone already
        self._ended.pop(fd, None)  # a new connection on the descriptor
        if fd >= self.lobby.fd_ceiling and not self.local:
            self.cut(stranger, "fd_reserve", f"descriptor {fd} is within the reserve")
            return None
        if not self._make_room(stranger):
            return None
        self.strangers[fd] = stranger
        stranger.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, stranger)
        self.lobby._check_soon()
        return stranger

    def bound(self, endpoint: str) -> None:
        """The socket listens at ``endpoint`` (``tcp://HOST:PORT``, ``ipc://PATH``)."""
        if endpoint.startswith("tcp://"):
            self.address = int(endpoint.rsplit(":", 1)[1])
        elif endpoint.startswith("ipc://"):
            self.address = endpoint.removeprefix("ipc://")

    def _record(self, fd: int) -> Stranger | None:
        """A stranger on ``fd``, if ``fd`` is a connection to this socket's address: an
        accept or a frame heard late may name a descriptor since reused by another
        socket of the process (the health port's), which is never touched."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return None
        try:
            ends = _ends(sock)
        except OSError:
            return None
        finally:
            sock.detach()
        local = ends[0][1] if isinstance(ends[0], tuple) else ends[0]
        if self.address is None or local != self.address:
            return None
        return Stranger(self, fd, ends, time.monotonic())

    def stranger(self, fd: int | None) -> Stranger | None:
        """The stranger on ``fd`` (accepted now if its accept event is still to come)."""
        if fd is None or fd in self.members:
            return None
        return self.strangers.get(fd) or self.accepted(fd)

    def hello(self, fd: int | None) -> None:
        stranger = self.strangers.get(fd) if fd is not None else None
        if stranger is not None:
            stranger.hello = True

    def admitted(self, fd: int | None) -> None:
        """``fd``'s connection authenticated (or needs not): no longer a stranger."""
        if fd is None or fd in self.members:
            return
        stranger = self.strangers.pop(fd, None)
        if stranger is not None and stranger.timer is not None:
            stranger.timer.cancel()
        self.members.add(fd)

    def refuse(self, fd: int | None, linger_s: float) -> None:
        """``fd``'s handshake was refused: cut it once the reply has had ``linger_s``."""
        if fd is None:
            return
        stranger = self.strangers.get(fd)
        if stranger is None:  # a member that broke the rules of its name: a stranger again
            self.members.discard(fd)
            stranger = self._record(fd)
            if stranger is not None:
                self.strangers[fd] = stranger
        if stranger is None or stranger.refused:
            return
        stranger.refused = True
        if stranger.timer is not None:
            stranger.timer.cancel()
        stranger.timer = asyncio.get_running_loop().call_later(
            linger_s, self.cut, stranger, "auth_refused", "its handshake was refused"
        )

    def refused(self, fd: int | None) -> bool:
        stranger = self.strangers.get(fd) if fd is not None else None
        return stranger is not None and stranger.refused

    def disconnected(self, fd: int) -> None:
        member, cut = fd in self.members, fd in self._cut
        self.members.discard(fd)
        stranger = self.strangers.pop(fd, None)
        if stranger is not None and stranger.timer is not None:
            stranger.timer.cancel()
        if stranger is not None or cut:
            self._cut.discard(fd)
            self.lobby._trim_soon()  # what its frames held goes back
        if not (member or cut or stranger is not None and stranger.refused):  # a stranger, or gone
            self._ended[fd] = None  # before it was recorded (its accept was heard after its end)
            if len(self._ended) > _ENDED_KEPT:
                del self._ended[next(iter(self._ended))]
        self.on_gone(fd)

    def ended(self, fd: int) -> bool:
        """Whether ``fd``'s stranger left before all its frames were read (a busy host reads
        them after ZeroMQ reported the end): they are judged and counted, not kept."""
        return fd in self._ended

    # -- bounds --------------------------------------------------------------------------
    def _make_room(self, newcomer: Stranger) -> bool:
        """Room for ``newcomer`` under both caps: evict the oldest idle stranger (this
        port's, then anyone's), or refuse the newcomer when all started the handshake."""
        lobby = self.lobby
        bounds: list[tuple[Callable[[], bool], list[Door], str]] = [
            (lambda: len(self.strangers) >= self.max_pending, [self], "max_pending"),
            (
                lambda: not self.local and lobby.num_strangers >= lobby.max_total,
                lobby.doors,
                "max_pending_total",
            ),
        ]
        for over, doors, limit in bounds:
            while over():
                victim = lobby._victim(doors, newcomer)
                if victim is None:
                    self.cut(
                        newcomer, "pending_limit", f"every pending connection is mid-handshake ({limit})"
                    )
                    return False
                victim.door.cut(victim, "pending_limit", f"an older one makes room for a newer one ({limit})")
        return True

    def _expire(self, stranger: Stranger) -> None:
        if self.strangers.get(stranger.fd) is stranger:
            self.cut(stranger, "handshake_timeout", f"no handshake within {self.timeout_s:g} s")

    def cut(self, stranger: Stranger, reason: str, why: str) -> None:
        """End ``stranger``'s connection and count it."""
        if self.strangers.get(stranger.fd) is stranger:
            del self.strangers[stranger.fd]
        if stranger.timer is not None:
            stranger.timer.cancel()
        shut = stranger.probe(_shut_down)
        if not shut:
            return  # it ended on its own meanwhile
        self._cut.add(stranger.fd)
        self.lobby._count(self.name, reason)
        log.info(
            "%s: dropped an unauthenticated connection (descriptor %d, %s): %s",
            self.name,
            stranger.fd,
            reason,
            why,
            extra={"reason": reason},
        )


def _shut_down(sock: socket.socket) -> bool:
    """End both directions of ``sock``'s connection (True: it was still there to end)."""
    sock.shutdown(socket.SHUT_RDWR)
    return True
