"""The session's rules as data: states, triggers and the transition table.

Rule 1: whether a message is legal in a session is decided here, by
:data:`TRANSITIONS` (and, for rooms, by
:data:`~pd_transfer.protocol.generations.FRESHNESS_RULES`). :mod:`session`
only looks these tables up, so docs generated from them describe the
behaviour exactly.

Rule 2: the table does not know which side *we* are. It is keyed by the role
of the *sender*; a session applies the same table to what it sends and to
what it receives, so the two ends cannot disagree about a rule.

The handshake. Decode connects, so it speaks first, and each handshake step
has exactly one legal sender, so no two handshake frames can cross::

    idle --decode hello--> greeting --prefill hello--> greeted
    greeted --decode register--> registering --prefill register--> registered
    registered --prefill verdict(accepted)--> accepted
               --prefill verdict(rejected)--> rejected

In ``accepted``: decode sends TransferRequest; prefill sends Progress and
Done; decode answers a successful room with its own Done (success only: it
has the bytes); either side sends Abort and AbortAck; decode sends RoomRefused for a room it gave up
before claiming it (to a prefill offering ``room_abandon``). In ``rejected``, decode
sends RoomRefused for each room it would have asked for. Heartbeats go both ways in every
state from ``greeted`` on. Either side may Close in any non-terminal state;
``closed`` and ``error`` have no way out.

Pure data; imports :mod:`messages` only.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from pd_transfer.errors import LocalProtocolError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol.messages import (
    Abort,
    AbortAck,
    Close,
    Done,
    Heartbeat,
    Hello,
    Message,
    Progress,
    Register,
    RoomRefused,
    TransferRequest,
    Verdict,
)


class SessionState(enum.Enum):
    IDLE = "idle"  # nothing exchanged
    GREETING = "greeting"  # decode said hello
    GREETED = "greeted"  # both said hello
    REGISTERING = "registering"  # decode sent its geometry
    REGISTERED = "registered"  # both sent their geometry; prefill owes a verdict
    ACCEPTED = "accepted"  # verdict accepted: rooms may flow
    REJECTED = "rejected"  # verdict rejected: heartbeats, decode's RoomRefused, close
    CLOSED = "closed"  # a Close went either way (terminal)
    ERROR = "error"  # the peer broke the protocol (terminal)


class Trigger(enum.Enum):
    """What moves the session: a message type, with Verdict split by outcome."""

    HELLO = "hello"
    REGISTER = "register"
    VERDICT_ACCEPTED = "verdict_accepted"
    VERDICT_REJECTED = "verdict_rejected"
    TRANSFER_REQUEST = "transfer_request"
    PROGRESS = "progress"
    DONE = "done"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"
    ROOM_REFUSED = "room_refused"
    HEARTBEAT = "heartbeat"
    CLOSE = "close"


_TRIGGER_BY_TYPE: dict[type[Message], Trigger] = {
    Hello: Trigger.HELLO,
    Register: Trigger.REGISTER,
    TransferRequest: Trigger.TRANSFER_REQUEST,
    Progress: Trigger.PROGRESS,
    Done: Trigger.DONE,
    Abort: Trigger.ABORT,
    AbortAck: Trigger.ABORT_ACK,
    RoomRefused: Trigger.ROOM_REFUSED,
    Heartbeat: Trigger.HEARTBEAT,
    Close: Trigger.CLOSE,
}

ROOM_TRIGGERS = frozenset(
    {Trigger.TRANSFER_REQUEST, Trigger.PROGRESS, Trigger.DONE, Trigger.ABORT, Trigger.ABORT_ACK}
)
TERMINAL_STATES = frozenset({SessionState.CLOSED, SessionState.ERROR})
#: states in which heartbeats flow (both agents know each other's id)
LIVE_STATES = (
    SessionState.GREETED,
    SessionState.REGISTERING,
    SessionState.REGISTERED,
    SessionState.ACCEPTED,
    SessionState.REJECTED,
)


def trigger_of(message: Message) -> Trigger:
    """The trigger ``message`` fires; LocalProtocolError if it is not a protocol message."""
    if isinstance(message, Verdict):
        return Trigger.VERDICT_ACCEPTED if message.accepted else Trigger.VERDICT_REJECTED
    trigger = _TRIGGER_BY_TYPE.get(type(message))
    if trigger is None:
        raise LocalProtocolError(
            f"{type(message).__name__} is not a protocol message", code=Reason.UNKNOWN_MESSAGE
        )
    return trigger


def _transitions() -> dict[tuple[SessionState, Role, Trigger], SessionState]:
    S, T, P, D = SessionState, Trigger, Role.PREFILL, Role.DECODE
    table = {
        (S.IDLE, D, T.HELLO): S.GREETING,
        (S.GREETING, P, T.HELLO): S.GREETED,
        (S.GREETED, D, T.REGISTER): S.REGISTERING,
        (S.REGISTERING, P, T.REGISTER): S.REGISTERED,
        (S.REGISTERED, P, T.VERDICT_ACCEPTED): S.ACCEPTED,
        (S.REGISTERED, P, T.VERDICT_REJECTED): S.REJECTED,
        (S.REJECTED, D, T.ROOM_REFUSED): S.REJECTED,  # decode's room fails on prefill too
        (S.ACCEPTED, D, T.TRANSFER_REQUEST): S.ACCEPTED,
        (S.ACCEPTED, D, T.ROOM_REFUSED): S.ACCEPTED,  # a room decode gave up before claiming it
        (S.ACCEPTED, P, T.PROGRESS): S.ACCEPTED,
        (S.ACCEPTED, P, T.DONE): S.ACCEPTED,
        (S.ACCEPTED, D, T.DONE): S.ACCEPTED,  # decode confirms it has the room's bytes
    }
    for role in Role:
        table[(S.ACCEPTED, role, T.ABORT)] = S.ACCEPTED
        table[(S.ACCEPTED, role, T.ABORT_ACK)] = S.ACCEPTED
        for state in LIVE_STATES:
            table[(state, role, T.HEARTBEAT)] = state
        for state in S:
            if state not in TERMINAL_STATES:
                table[(state, role, T.CLOSE)] = S.CLOSED
    return table


#: (state, sender role, trigger) -> next state. Every key absent is illegal.
TRANSITIONS = MappingProxyType(_transitions())


def allowed(state: SessionState) -> list[tuple[Role, Trigger]]:
    """Every (sender, trigger) legal in ``state``, in table order."""
    return [(role, trigger) for (s, role, trigger) in TRANSITIONS if s is state]
