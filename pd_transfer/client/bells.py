"""The worker's side of doorbells: which room rings where, and waiting on it.

A decode sidecar with doorbells (:mod:`pd_transfer.doorbell`) answers
``expect`` with the room's slot; the client maps the sidecar's segment once
and, in ``wait``, sleeps on the slot first. A ring means every byte of the
room has landed: ``wait`` returns Success without a message. Anything else
(the slot closed because the sidecar decided the room, the wait timed out,
or the room has no doorbell) goes to the sidecar as before, which then
answers at once or waits out what is left of the timeout.

No asyncio, no zmq: used by both clients.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pd_transfer.doorbell import AVAILABLE, Doorbells, Outcome
from pd_transfer.errors import PdTransferError

log = logging.getLogger(__name__)

MAX_ROOMS = 65536   # rooms remembered at most (the oldest go first): waits past it ask the sidecar


class RoomBells:
    def __init__(self) -> None:
        self._segments: dict[str, Doorbells] = {}
        self._rooms: dict[int, tuple[Doorbells, int, int]] = {}

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
        segment = self._segments.get(name)
        if segment is None:
            try:
                segment = self._segments[name] = Doorbells.open(name)
            except PdTransferError as err:
                log.warning("room %d: cannot map the sidecar's doorbells (%s); waiting through "
                            "messages", room, err.message)
                return
        if not 0 <= slot < segment.slots:
            log.warning("room %d: doorbell slot %d out of range", room, slot)
            return
        if len(self._rooms) >= MAX_ROOMS:
            del self._rooms[next(iter(self._rooms))]
        self._rooms[room] = (segment, slot, token)

    def wait(self, room: int, timeout_s: float, cancelled: threading.Event | None = None) -> Outcome | None:
        """Sleep on ``room``'s doorbell (None: it has none). RUNG forgets the room."""
        entry = self._rooms.get(room)
        if entry is None:
            return None
        segment, slot, token = entry
        outcome = segment.wait(slot, token, timeout_s, cancelled)
        if outcome is Outcome.RUNG:
            self._rooms.pop(room, None)
        return outcome

    def interrupt(self, room: int) -> None:
        """Wake a thread sleeping in :meth:`wait` for ``room`` (its wait was cancelled)."""
        entry = self._rooms.get(room)
        if entry is not None:
            entry[0].interrupt(entry[1])

    def forget(self, room: int) -> None:
        self._rooms.pop(room, None)

    def close(self) -> None:
        self._rooms.clear()
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


__all__ = ["RoomBells"]
