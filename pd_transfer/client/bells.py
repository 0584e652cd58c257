"""The worker's side of doorbells: which room rings where, and waiting on it.

A decode sidecar with doorbells (:mod:`pd_transfer.memory.doorbell`) answers
``expect`` with the room's slot; the client maps the sidecar's segment once
and, in ``wait``, sleeps on the slot first. A ring means every byte of the
room has landed: ``wait`` returns Success without a message. Anything else
(the slot closed because the sidecar decided the room, the wait timed out,
or the room has no doorbell) goes to the sidecar as before, which then
answers at once or waits out what is left of the timeout.

The blocking client sleeps on the room's slot in the calling thread. The
asyncio client cannot spend a thread per waiting room: one watcher thread per
segment sleeps on the segment's own bell (slot 0, which moves with every
slot), looks at the rooms awaited when it moves, and settles their futures
on their event loop.

No zmq; asyncio only for the futures the watcher settles.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pd_transfer.client.status import RoomState
from pd_transfer.errors import PdTransferError
from pd_transfer.memory.doorbell import AVAILABLE, Doorbells, Outcome

log = logging.getLogger(__name__)

MAX_ROOMS = 65536  # rooms remembered at most (the oldest go first): waits past it ask the sidecar
LIVENESS_CHECK_S = 0.25  # a blocking wait on a doorbell looks at the sidecar's connection this often


class WorkerBells:
    """The worker client's doorbells: which room rings where, and the waits on them."""

    def __init__(self) -> None:
        self._segments: dict[str, Doorbells | None] = {}  # None: could not be mapped
        self._rooms: dict[int, tuple[Doorbells, int, int]] = {}
        self._watchers: dict[str, _Watcher] = {}

    def note(self, room: int, reply: dict[str, Any]) -> None:
        """Remember ``room``'s doorbell from the sidecar's ``expect`` reply (if it has one)."""
        self._rooms.pop(room, None)
        bell = reply.get("doorbell")
        if not AVAILABLE or not isinstance(bell, dict):
            return
        name, slot, token = bell.get("segment"), bell.get("slot"), bell.get("token")
        if not (isinstance(name, str) and type(slot) is int and type(token) is int):
            log.warning("room %d: ignoring a malformed doorbell in the expect reply: %r", room, bell)
            return
        if name not in self._segments:
            try:
                self._segments[name] = Doorbells.open(name)
            except PdTransferError as err:  # said once; its rooms wait through messages
                self._segments[name] = None
                log.warning(
                    "cannot map the sidecar's doorbells (%s); rooms are waited for through messages",
                    err.message,
                )
        segment = self._segments[name]
        if segment is None:
            return
        if not 0 < slot < segment.slots:
            log.warning("room %d: doorbell slot %d out of range", room, slot)
            return
        if len(self._rooms) >= MAX_ROOMS:
            del self._rooms[next(iter(self._rooms))]
        self._rooms[room] = (segment, slot, token)

    def wait(self, room: int, timeout_s: float, alive: Callable[[], bool] | None = None) -> Outcome | None:
        """Sleep on ``room``'s doorbell (None: it has none). RUNG forgets the room.

        ``alive``, asked every :data:`LIVENESS_CHECK_S` while nothing rang: False
        (the sidecar closed the worker's connection) raises ConnectionError, since
        a dead sidecar closes no slot and the sleep would last the whole timeout.
        """
        entry = self._rooms.get(room)
        if entry is None:
            return None
        segment, slot, token = entry
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            outcome = segment.wait(slot, token, left if alive is None else min(left, LIVENESS_CHECK_S))
            if outcome is not Outcome.TIMEOUT or time.monotonic() >= deadline:
                break
            if alive is not None and not alive():
                raise ConnectionError(
                    f"the sidecar closed the connection while room {room} waited on its doorbell"
                )
        if outcome is Outcome.RUNG:
            self._rooms.pop(room, None)
        return outcome

    async def wait_async(
        self, room: int, timeout_s: float, gone: asyncio.Future | None = None
    ) -> Outcome | None:
        """:meth:`wait` for an event loop: the segment's watcher thread does the sleeping.

        ``gone`` resolves (to a ConnectionError) when the sidecar closes the worker's
        connection: the wait then raises it instead of sleeping out its timeout.
        """
        entry = self._rooms.get(room)
        if entry is None:
            return None
        segment, slot, token = entry
        outcome = segment.peek(slot, token)
        if outcome is None:
            watcher = self._watchers.get(segment.name)
            if watcher is None:
                watcher = self._watchers[segment.name] = _Watcher(segment)
            future = asyncio.get_running_loop().create_future()
            watcher.add(future, slot, token)
            try:
                async with asyncio.timeout(timeout_s):
                    if gone is not None:
                        await asyncio.wait((future, gone), return_when=asyncio.FIRST_COMPLETED)
                        if not future.done():
                            raise gone.result()
                    outcome = await future
            except TimeoutError:
                outcome = Outcome.TIMEOUT
            finally:
                watcher.remove(future)
        if outcome is Outcome.RUNG:
            self._rooms.pop(room, None)
        return outcome

    def forget(self, room: int) -> None:
        self._rooms.pop(room, None)

    def seen(self, room: int, state: RoomState) -> RoomState:
        """``state``, the sidecar's answer for ``room``; a terminal one forgets the room."""
        if state.is_terminal:
            self.forget(room)
        return state

    def close(self) -> None:
        self._rooms.clear()
        for watcher in self._watchers.values():
            watcher.close()
        self._watchers.clear()
        for segment in self._segments.values():
            if segment is not None:
                segment.close()
        self._segments.clear()


class _Watcher:
    """A thread that sleeps on one segment's bell for the futures of the rooms awaited."""

    def __init__(self, segment: Doorbells) -> None:
        self.segment = segment
        self._lock = threading.Lock()
        self._waits: dict[asyncio.Future, tuple[int, int, asyncio.AbstractEventLoop]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, future: asyncio.Future, slot: int, token: int) -> None:
        with self._lock:
            self._waits[future] = (slot, token, future.get_loop())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name=f"pdt-bells-{self.segment.name[-12:]}"
                )
                self._thread.start()
        self.segment.interrupt(0)  # look again, with this one

    def remove(self, future: asyncio.Future) -> None:
        with self._lock:
            self._waits.pop(future, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._waits.clear()
        self.segment.interrupt(0)

    def _run(self) -> None:
        while True:
            bell = self.segment.bell()  # before looking: a change after it ends the sleep
            with self._lock:
                if self._closed:
                    return
                waits = list(self._waits.items())
            for future, (slot, token, loop) in waits:
                outcome = self.segment.peek(slot, token)
                if outcome is None:
                    continue
                self.remove(future)
                try:
                    loop.call_soon_threadsafe(_settle, future, outcome)
                except RuntimeError:  # its loop is closed: nobody is waiting any more
                    pass
            self.segment.sleep(0, bell, 1.0)


def _settle(future: asyncio.Future, outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)


__all__ = ["WorkerBells"]
