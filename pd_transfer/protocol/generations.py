"""Room generations on one session: is a room message fresh, stale or wrong?

Decode opens a generation of a room with a TransferRequest; every later
message about the room (Progress, Done, Abort, AbortAck) names the generation
it is about. After an abort decode may re-request the room with a higher
generation, and whatever the old generation still produces must not touch the
new attempt. :class:`RoomGenerations` classifies each room message against the
newest generation the session has seen; :data:`FRESHNESS_RULES` says what the
session does with each class (data, so docs can list it).

Pure; no I/O.
"""

from __future__ import annotations

import enum

from pd_transfer.errors import Reason
from pd_transfer.protocol.messages import Message, RoomMessage, TransferRequest


class Freshness(enum.Enum):
    FRESH = "fresh"  # about the current generation (or opens a newer one)
    STALE = "stale"  # about an older generation
    UNKNOWN_ROOM = "unknown_room"  # no request for this room on this session (or forgotten)
    DUPLICATE = "duplicate"  # a TransferRequest for the current generation again
    FUTURE = "future"  # names a generation no request opened


class Handling(enum.Enum):
    DELIVER = "deliver"  # hand the message to the caller
    DROP = "drop"  # received: report it as Dropped, change nothing
    VIOLATION = "violation"  # received: RemoteProtocolError with a reply for the room


#: freshness -> (what a receiving session does, the reason it reports)
FRESHNESS_RULES: dict[Freshness, tuple[Handling, Reason | None]] = {
    Freshness.FRESH: (Handling.DELIVER, None),
    Freshness.STALE: (Handling.DROP, Reason.STALE_GENERATION),
    Freshness.UNKNOWN_ROOM: (Handling.DROP, Reason.UNKNOWN_ROOM),
    Freshness.DUPLICATE: (Handling.VIOLATION, Reason.DUPLICATE_ROOM),
    Freshness.FUTURE: (Handling.VIOLATION, Reason.BAD_GENERATION),
}


class RoomGenerations:
    """The newest generation per room seen on one session (sent or received)."""

    def __init__(self) -> None:
        self._current: dict[int, int] = {}

    def current(self, room: int) -> int | None:
        return self._current.get(room)

    def classify(self, message: RoomMessage) -> Freshness:
        """Freshness of a room message; does not record anything."""
        room, generation = message.room, message.generation
        current = self._current.get(room)
        if isinstance(message, TransferRequest):
            if current is None or generation > current:
                return Freshness.FRESH
            return Freshness.DUPLICATE if generation == current else Freshness.STALE
        if current is None:
            return Freshness.UNKNOWN_ROOM
        if generation < current:
            return Freshness.STALE
        return Freshness.FUTURE if generation > current else Freshness.FRESH

    def record(self, message: Message) -> None:
        """Note a fresh TransferRequest's generation as the room's current one."""
        if isinstance(message, TransferRequest):
            self._current[message.room] = message.generation

    def forget(self, room: int) -> None:
        """Stop tracking ``room`` (it concluded); later messages about it are unknown."""
        self._current.pop(room, None)

    def __len__(self) -> int:
        return len(self._current)
