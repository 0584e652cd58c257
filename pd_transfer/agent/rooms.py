"""Rooms as the agent tracks them: status, deadline, waiters, index lists.

The status rules (monotonic, Failed sticky with a reason, Success final) are
:class:`pd_transfer.protocol.RoomGeneration`'s; this module adds what needs a
clock and an event loop: a deadline per non-terminal status, futures the
worker's ``wait`` calls sleep on, and a table that forgets terminal rooms
after a TTL.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from pd_transfer.errors import Reason
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import RoomGeneration, RoomStatus
from pd_transfer.protocol.worker_requests import RoomPages


@dataclass
class Room:
    """One room on one side. Subclassed per role for its bookkeeping."""

    room: int
    generation: int
    state: RoomGeneration = field(init=False)
    created_s: float = field(default_factory=time.monotonic)
    deadline_s: float = float("inf")
    finished_s: float = 0.0
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    on_end: list[Callable[[Room], None]] = field(default_factory=list)  # called once, when terminal

    def __post_init__(self) -> None:
        self.state = RoomGeneration(self.room, self.generation)

    @property
    def status(self) -> RoomStatus:
        return self.state.status

    @property
    def terminal(self) -> bool:
        return self.state.is_terminal

    def advance(self, status: RoomStatus, deadline_s: float = float("inf")) -> None:
        before = self.state.status
        self.state = self.state.advance(status)
        if self.state.status is not before:
            self.deadline_s = deadline_s
            self._settle()

    def fail(self, reason: Reason, text: str) -> bool:
        """Fail the room; False if it was already terminal (the first outcome stands)."""
        if self.terminal:
            return False
        self.state = self.state.fail(reason, text)
        self._settle()
        return True

    def _settle(self) -> None:
        if self.terminal:
            self.finished_s = time.monotonic()
            self.deadline_s = float("inf")
            for waiter in self.waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self.waiters.clear()
            hooks, self.on_end = self.on_end, []
            for hook in hooks:  # e.g. admission slots go back (agent/admission.py)
                hook(self)

    def reply(self) -> dict[str, Any]:
        reply: dict[str, Any] = {"status": self.state.status.value}
        if self.state.status is RoomStatus.FAILED and self.state.reason is not None:
            reply.update(code=self.state.reason.value, reason=self.state.reason_text)
        return reply

    async def wait(self, timeout_s: float) -> None:
        if self.terminal:
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiters.append(waiter)
        # a timer that answers the waiter, rather than asyncio.wait_for around it: the
        # room's end then wakes the worker's call in one step of the loop, not three
        timer = loop.call_later(timeout_s, _answer, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if waiter in self.waiters:
                self.waiters.remove(waiter)


def _answer(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


RoomT = TypeVar("RoomT", bound=Room)
RoomT_co = TypeVar("RoomT_co", bound=Room, covariant=True)


class RoomView(Protocol[RoomT_co]):
    """A room table read, not changed (``/status``, a lost worker's count): either
    role's table is a ``RoomView[Room]``."""

    @property
    def rooms(self) -> Mapping[int, RoomT_co]: ...

    def live(self) -> Sequence[RoomT_co]: ...

    def counts(self) -> dict[str, int]: ...


class RoomTable(Generic[RoomT]):
    """Live and recently finished rooms, of one side's room type; terminal ones are
    forgotten after ``ttl_s``.

    Bounded: at most ``max_rooms`` live rooms (the sidecar refuses more), and
    at most ``max_rooms`` terminal ones (the oldest finished are forgotten
    first, even before ``ttl_s``, when rooms finish faster than that).
    """

    def __init__(self, ttl_s: float, max_rooms: int) -> None:
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self.rooms: dict[int, RoomT] = {}
        # the live rooms, kept as they start and end: the limit check on every send or
        # expect must not scan the whole table (up to 2 x max_rooms rooms)
        self._live: dict[int, RoomT] = {}
        # the terminal ones in the order they finished (oldest first): the sweep every
        # 100 ms and the eviction over the bound take them from the front, never scan
        self._finished: dict[int, RoomT] = {}

    def get(self, room: int) -> RoomT | None:
        return self.rooms.get(room)

    def add(self, room: RoomT) -> None:
        replaced = self.rooms.get(room.room)
        if replaced is not None:
            if self._live.get(room.room) is replaced:
                del self._live[room.room]
            if self._finished.get(room.room) is replaced:
                del self._finished[room.room]
        self.rooms[room.room] = room
        if room.terminal:
            self._finished[room.room] = room
        else:
            self._live[room.room] = room
            room.on_end.append(self._ended)
        if len(self.rooms) > 2 * self.max_rooms:
            self._forget_oldest(len(self.rooms) - 2 * self.max_rooms + self.max_rooms // 8 + 1)

    def _ended(self, room: Room) -> None:
        live = self._live.get(room.room)
        if live is not None and live is room:
            del self._live[room.room]
            self._finished[room.room] = live

    def _forget_oldest(self, count: int) -> None:
        for room_id in list(itertools.islice(self._finished, count)):
            del self._finished[room_id]
            del self.rooms[room_id]

    def live(self) -> list[RoomT]:
        return list(self._live.values())

    def refusal(self, room: int) -> str:
        """Why a new ``room`` may not be added ('' when it may): ``max_rooms`` are live."""
        if room in self._live:
            return ""
        live = len(self._live)
        return (
            "" if live < self.max_rooms else f"{live} rooms are live, the limit is max_rooms={self.max_rooms}"
        )

    def expire(self, now_s: float, on_timeout: Callable[[RoomT], None]) -> None:
        """Time out live rooms past their deadline; forget rooms finished over ``ttl_s`` ago.

        Costs the live rooms plus the expired ones, not the whole table.
        """
        for room in [r for r in self._live.values() if now_s > r.deadline_s]:
            on_timeout(room)
        stale = 0
        for room in self._finished.values():
            if now_s - room.finished_s <= self.ttl_s:
                break
            stale += 1
        if stale:
            self._forget_oldest(stale)

    def counts(self) -> dict[str, int]:
        counts = {s.value: 0 for s in RoomStatus}
        for room in self.rooms.values():
            counts[room.status.value] += 1
        return counts


def pool_requests(request: RoomPages) -> dict[Pool, np.ndarray]:
    """Index lists of a worker send/expect request, by pool (empty pools left out)."""
    lists: dict[Pool, Sequence[int]] = {
        Pool.KV: request.pages,
        Pool.SWA: request.swa_pages,
        Pool.MAMBA: request.state_slots,
    }
    if request.aux_row is not None:
        lists[Pool.AUX] = [request.aux_row]
    return {pool: np.asarray(values, dtype=np.int64) for pool, values in lists.items() if len(values)}
