"""The status of one room (one request's transfer), as a monotonic machine.

    Bootstrapping -> WaitingForInput -> Transferring -> Success
          \\________________\\________________\\________-> Failed

Rules (data: :data:`ROOM_TRANSITIONS`):

- Status only moves forward. Asking for a status at or below the current
  one is ignored, never a regression (a late Progress after Done changes
  nothing).
- Failed is terminal and sticky, and always carries a reason code and text.
  The first failure wins; later ones are ignored.
- Success is terminal too: once every byte has landed the room is done, and
  a later failure (an Abort that crossed the final Done) does not turn it
  into Failed. Decode may already have handed the pages to the model;
  reporting Failed then would make the worker discard good data or, worse,
  reuse pages it believes are unwritten while it consumes them.
- A :class:`RoomGeneration` is one *generation* (attempt) of a room. Messages of
  another generation do not touch it: older ones are stale, and a newer
  generation is a new attempt that gets a fresh :class:`RoomGeneration`.

Pure; no I/O, no clocks (timeouts belong to the agent).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from pd_transfer.errors import LocalProtocolError, Reason
from pd_transfer.protocol.messages import Abort, Done, DoneStatus, Progress, RoomMessage


class RoomStatus(enum.Enum):
    """A room's status, on the sidecar and as its worker sees it. The value is the wire spelling."""

    BOOTSTRAPPING = "bootstrapping"  # decode resolving peers / prefill awaiting the request
    WAITING_FOR_INPUT = "waiting_for_input"  # request sent or received, no bytes yet
    TRANSFERRING = "transferring"  # some bytes have moved
    SUCCESS = "success"  # every byte landed (terminal)
    FAILED = "failed"  # terminal, sticky, with a reason

    @property
    def is_terminal(self) -> bool:
        return self in (RoomStatus.SUCCESS, RoomStatus.FAILED)


_S = RoomStatus

#: status -> the statuses it may move to. Anything else is ignored.
ROOM_TRANSITIONS: dict[RoomStatus, frozenset[RoomStatus]] = {
    _S.BOOTSTRAPPING: frozenset({_S.WAITING_FOR_INPUT, _S.TRANSFERRING, _S.SUCCESS, _S.FAILED}),
    _S.WAITING_FOR_INPUT: frozenset({_S.TRANSFERRING, _S.SUCCESS, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.SUCCESS, _S.FAILED}),
    _S.SUCCESS: frozenset(),
    _S.FAILED: frozenset(),
}

TERMINAL_STATUSES = frozenset(s for s, moves in ROOM_TRANSITIONS.items() if not moves)


@dataclass(frozen=True)
class RoomGeneration:
    """One generation of one room. Immutable: every change returns a new state."""

    room: int
    generation: int
    status: RoomStatus = RoomStatus.BOOTSTRAPPING
    reason: Reason | None = None
    reason_text: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def advance(self, status: RoomStatus) -> RoomGeneration:
        """Move forward to ``status``; a lower or equal status is ignored."""
        if status is RoomStatus.FAILED:
            raise LocalProtocolError(
                "use fail(reason, text): a failure needs a reason", code=Reason.BAD_FIELD
            )
        if status not in ROOM_TRANSITIONS[self.status]:
            return self
        return replace(self, status=status)

    def fail(self, reason: Reason, text: str) -> RoomGeneration:
        """Fail with ``reason``; ignored once the room is terminal (first failure wins)."""
        if not isinstance(reason, Reason) or not text:
            raise LocalProtocolError(
                f"room {self.room}: a failure needs a reason code and text, got {reason!r} {text!r}",
                code=Reason.BAD_FIELD,
            )
        if RoomStatus.FAILED not in ROOM_TRANSITIONS[self.status]:
            return self
        return replace(self, status=RoomStatus.FAILED, reason=reason, reason_text=text)

    def apply(self, message: RoomMessage) -> RoomGeneration:
        """The state after a Progress, Done or Abort of this room.

        A message of another generation is ignored (see the module docstring);
        one about another room is a bug of the caller.
        """
        room = getattr(message, "room", None)
        if room != self.room:
            raise LocalProtocolError(
                f"room {self.room} was given a message about room {room}", code=Reason.UNKNOWN_ROOM
            )
        if message.generation != self.generation:
            return self
        if isinstance(message, Progress):
            return self.advance(RoomStatus.TRANSFERRING)
        if isinstance(message, Done):
            if message.status is DoneStatus.SUCCESS:
                return self.advance(RoomStatus.SUCCESS)
            return self.fail(message.reason or Reason.UNRECOGNIZED_REASON, message.reason_text)
        if isinstance(message, Abort):
            return self.fail(message.reason, message.reason_text)
        return self
