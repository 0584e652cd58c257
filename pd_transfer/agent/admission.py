"""Admission: rooms per peer and bytes in flight, bounded, with fair, bounded waits.

A room (or a chunk write) over a limit neither fails at once nor queues
forever: it waits, first come first served per peer and round robin across
peers, until enough frees up or its deadline passes (``admission_wait_s``
from the moment it asked, never beyond the room's own deadline), then fails
with ``backpressure_timeout`` and a text naming the limit, its value and the
fix. A room that ends while waiting (aborted, timed out, its peer lost)
leaves the queue at once.

The limits (``pd_transfer.config.sidecar.SidecarConfig``):

    max_rooms_per_peer          rooms live with one peer at once (both roles;
                                decode: a peer is a prefill instance)
    max_inflight_nbytes         bytes being written to one decode peer (prefill)
    max_inflight_nbytes_total   bytes being written to all decode peers (prefill)

A request larger than a limit is admitted alone, once nothing else holds
that limit: a big chunk is never refused outright, and memory stays bounded
by one chunk. Fairness: a peer's requests are served in arrival order; the
peer first in turn whose head request fits its own limit is served next, and
if that request does not fit the total no later peer overtakes it (so a big
request is not starved by a stream of small ones), while a peer at its own
limit never blocks the others.

Pure asyncio bookkeeping: no sockets, no metrics, no config parsing. The
agent reads :meth:`Limiter.in_use_total` and friends at scrape time and
hears about waits through the ``on_admitted`` / ``on_timeout`` hooks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pd_transfer.errors import PdTransferError, Reason

if TYPE_CHECKING:
    from pd_transfer.agent.rooms import Room
    from pd_transfer.config.sidecar import SidecarConfig


@dataclass(eq=False)
class Grant:
    """What one admitted request holds until :meth:`release` (idempotent)."""

    limiter: Limiter
    peer: str
    amount: int
    room: int
    released: bool = False

    def release(self) -> None:
        self.limiter.release(self)


@dataclass(eq=False)
class _Waiter:
    peer: str
    amount: int
    room: int
    what: str
    future: asyncio.Future[Grant]
    since_s: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None
    grant: Grant | None = None


def _nbytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Limiter:
    """One resource (``rooms`` or ``bytes``) limited per peer and, optionally, in total."""

    def __init__(
        self, resource: str, per_peer: tuple[str, int], total: tuple[str, int] | None = None, *, fix: str = ""
    ) -> None:
        self.resource = resource  # the metrics label
        self.per_peer_name, self.per_peer = per_peer
        self.total_name, self.total = total or ("", 0)  # 0: no total limit
        self.fix = fix  # what to look at besides the limits
        self._in_use: dict[str, int] = {}  # peer -> amount granted (no zero entries)
        # peers with waiters, in turn order (a dict keeps insertion order; served -> to the back)
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._by_room: dict[int, set[_Waiter | Grant]] = {}
        self.in_use_total = 0
        self.peak = 0  # highest in_use_total so far
        self.on_admitted: Callable[[str, float], None] = lambda resource, waited_s: None
        self.on_timeout: Callable[[str, str, float], None] = lambda resource, limit, waited_s: None

    # -- queries ----------------------------------------------------------------------
    def in_use(self, peer: str) -> int:
        return self._in_use.get(peer, 0)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def _show(self, amount: int) -> str:
        return _nbytes_text(amount) if self.resource == "bytes" else f"{amount} room(s)"

    def _setting(self, name: str, value: int) -> str:
        """``max_inflight_nbytes_total=6144 (6.0 KiB)``: the key as configured, then readable."""
        readable = f" ({_nbytes_text(value)})" if self.resource == "bytes" and value >= 1024 else ""
        return f"{name}={value}{readable}"

    def _fits_peer(self, peer: str, amount: int) -> bool:
        used = self._in_use.get(peer, 0)
        return used == 0 or used + amount <= self.per_peer

    def _fits_total(self, amount: int) -> bool:
        return not self.total or self.in_use_total == 0 or self.in_use_total + amount <= self.total

    # -- acquire / release ------------------------------------------------------------
    async def acquire(self, peer: str, amount: int, room: int, deadline_s: float, *, what: str) -> Grant:
        """Wait for ``amount`` under both limits; raises ``backpressure_timeout`` at
        ``deadline_s`` (time.monotonic), or ``aborted`` if :meth:`end_room` ends ``room``."""
        if not self._waiting and self._fits_peer(peer, amount) and self._fits_total(amount):
            return self._take(peer, amount, room, time.monotonic())  # nobody waits: no queue
        loop = asyncio.get_running_loop()
        waiter = _Waiter(peer, amount, room, what, loop.create_future())
        self._waiting.setdefault(peer, deque()).append(waiter)
        self._by_room.setdefault(room, set()).add(waiter)
        self._dispatch()
        if not waiter.future.done():
            waiter.timer = loop.call_later(max(0.0, deadline_s - time.monotonic()), self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._withdraw(waiter)
            if waiter.grant is not None:  # granted, but the caller went away before using it
                self.release(waiter.grant)
            raise

    def release(self, grant: Grant) -> None:
        if grant.released:
            return
        grant.released = True
        self._forget(grant.room, grant)
        self._give_back(grant)
        self._dispatch()

    def _give_back(self, grant: Grant) -> None:
        used = self._in_use[grant.peer] - grant.amount
        if used:
            self._in_use[grant.peer] = used
        else:
            del self._in_use[grant.peer]
        self.in_use_total -= grant.amount

    def end_room(self, room: int, *, release: bool, peer: str | None = None) -> None:
        """``room`` ended: its waiters (for ``peer``, or all) fail with ``aborted``; with
        ``release``, its grants go too."""
        items = [i for i in self._by_room.get(room, ()) if peer is None or i.peer == peer]
        # every waiter first, without granting anything in between: a grant made while
        # the room's own waiters leave could go to one of them
        for waiter in [i for i in items if isinstance(i, _Waiter)]:
            if self._withdraw(waiter, dispatch=False) and not waiter.future.done():
                waiter.future.set_exception(
                    PdTransferError(f"room {room} ended while waiting for {waiter.what}", code=Reason.ABORTED)
                )
        for grant in [i for i in items if isinstance(i, Grant) and release]:
            grant.released = True
            self._forget(grant.room, grant)
            self._give_back(grant)
        self._dispatch()

    # -- internals --------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Grant heads of queues, round robin, until the first one that must keep waiting."""
        while True:
            for peer, queue in self._waiting.items():
                head = queue[0]
                if head.future.done():
                    break  # cancelled, its task not yet told: drop it below
                if not self._fits_peer(peer, head.amount):
                    continue  # that peer is at its own limit: the others go on
                if not self._fits_total(head.amount):
                    return  # first in turn for the total: nobody overtakes it
                break
            else:
                return
            if head.future.done():
                self._withdraw(head, dispatch=False)
                continue
            queue.popleft()
            del self._waiting[peer]
            if queue:
                self._waiting[peer] = queue  # back of the turn order
            self._grant(head)

    def _grant(self, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._forget(waiter.room, waiter)
        waiter.grant = self._take(waiter.peer, waiter.amount, waiter.room, waiter.since_s)
        waiter.future.set_result(waiter.grant)

    def _take(self, peer: str, amount: int, room: int, since_s: float) -> Grant:
        grant = Grant(self, peer, amount, room)
        self._by_room.setdefault(room, set()).add(grant)
        self._in_use[peer] = self._in_use.get(peer, 0) + amount
        self.in_use_total += amount
        self.peak = max(self.peak, self.in_use_total)
        self.on_admitted(self.resource, time.monotonic() - since_s)
        return grant

    def _withdraw(self, waiter: _Waiter, *, dispatch: bool = True) -> bool:
        """Take a waiter out of its queue; False if it was not waiting any more."""
        queue = self._waiting.get(waiter.peer)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.peer]
        if waiter.timer is not None:
            waiter.timer.cancel()
        self._forget(waiter.room, waiter)
        if dispatch:
            self._dispatch()  # a removed head may have blocked the others
        return True

    def _forget(self, room: int, item: _Waiter | Grant) -> None:
        items = self._by_room.get(room)
        if items is not None:
            items.discard(item)
            if not items:
                del self._by_room[room]

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        error = self._timeout_error(waiter)  # before withdrawing: the queue as it stood
        if self._withdraw(waiter):
            waiter.future.set_exception(error)

    def _timeout_error(self, waiter: _Waiter) -> PdTransferError:
        waited_s = time.monotonic() - waiter.since_s
        queue = self._waiting.get(waiter.peer, deque())
        ahead = list(queue).index(waiter) if waiter in queue else 0
        used = self._in_use.get(waiter.peer, 0)
        if ahead or not self._fits_peer(waiter.peer, waiter.amount) or not self.total:
            limit, value = self.per_peer_name, self.per_peer
            state = (
                f"{waiter.peer} holds {self._show(used)} of {self._setting(limit, value)}"
                f"{f' and {ahead} earlier request(s) wait' if ahead else ''}"
            )
        else:
            limit, value = self.total_name, self.total
            state = f"all peers hold {self._show(self.in_use_total)} of {self._setting(limit, value)}"
        self.on_timeout(self.resource, limit, waited_s)
        return PdTransferError(
            f"waited {waited_s:.2f} s for {waiter.what}: {state}; raise {limit} or "
            f"admission_wait_s{f', or {self.fix}' if self.fix else ''}",
            code=Reason.BACKPRESSURE_TIMEOUT,
            hint=f"raise {limit} or admission_wait_s",
        )


class Admission:
    """The sidecar's limiters; rooms release what they hold when they end."""

    def __init__(self, config: SidecarConfig) -> None:
        self.wait_s = config.admission_wait_s
        self.rooms = Limiter(
            "rooms",
            ("max_rooms_per_peer", config.max_rooms_per_peer),
            fix="find why rooms with that peer finish slowly",
        )
        self.nbytes = Limiter(
            "bytes",
            ("max_inflight_nbytes", config.max_inflight_nbytes),
            ("max_inflight_nbytes_total", config.max_inflight_nbytes_total),
            fix="find why writes to that peer are slow",
        )

    def limiters(self) -> tuple[Limiter, ...]:
        return (self.rooms, self.nbytes)

    def deadline_s(self, room: Room) -> float:
        return min(time.monotonic() + self.wait_s, room.deadline_s)

    async def admit_room(self, peer: str, room: Room) -> None:
        """Hold a room slot with ``peer`` until ``room`` ends (success or failure)."""
        self._watch(room)
        await self.rooms.acquire(
            peer, 1, room.room, self.deadline_s(room), what="a room slot"
        )  # the text names the peer next

    async def admit_nbytes(self, peer: str, room: Room, nbytes: int) -> Grant:
        """Hold ``nbytes`` of in-flight budget to ``peer``; the caller releases the grant."""
        self._watch(room)
        return await self.nbytes.acquire(
            peer, nbytes, room.room, self.deadline_s(room), what=f"{_nbytes_text(nbytes)} to {peer}"
        )

    def withdraw(self, room: Room, peer: str) -> None:
        """Stop ``room``'s waits for ``peer`` now (an abort that must not wait for them)."""
        for limiter in self.limiters():
            limiter.end_room(room.room, release=False, peer=peer)

    def _watch(self, room: Room) -> None:
        if room.terminal:  # its end hooks ran already: nothing would release what it gets
            raise PdTransferError(f"room {room.room} ended before admission", code=Reason.ABORTED)
        if self._room_ended not in room.on_end:
            room.on_end.append(self._room_ended)

    def _room_ended(self, room: Room) -> None:
        self.rooms.end_room(room.room, release=True)
        self.nbytes.end_room(room.room, release=False)  # a write in progress releases its own
