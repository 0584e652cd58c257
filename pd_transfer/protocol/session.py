"""One end of a prefill-decode session, sans-IO (after h11's Connection).

The rules live in :mod:`transitions` (the session table) and
:mod:`generations` (room freshness); :class:`Session` applies them to every
message it sends and receives, and keeps what the handshake established.

What the caller gets:

- :meth:`Session.send` returns the frame to write, or raises
  :class:`LocalProtocolError`: the message is illegal for us now, or its frame
  would fail the peer's decoder (send decodes its own frame to be sure).
  Nothing is returned and the state is unchanged (it is a bug on our side).
- :meth:`Session.receive_data` returns the decoded message; or a
  :class:`Dropped` for a stale generation, an unknown room, or a frame that
  crossed our Close; or raises :class:`RemoteProtocolError`, whose ``reply``
  is the message to send back:

  * session-level (a bad frame, a message illegal in this state, a role or
    major-version mismatch): a :class:`Close` with the reason; the session is
    now ``error``, and any further call raises ``session_failed``;
  * room-level (a duplicate request, a generation nobody opened): a failed
    :class:`Done` (we are prefill) or an :class:`Abort` (we are decode) of
    that room at its current generation, so the reply is fresh for the peer
    and cannot bounce back; the session stays usable.

Typical use in an agent::

    try:
        event = session.receive_data(frame)
    except RemoteProtocolError as exc:
        await peer.write(session.send(exc.reply))  # then drop the peer if it was a Close

Pure; no sockets, no clocks, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_transfer.errors import LocalProtocolError, ProtocolError, Reason, RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol.codec import decode, encode
from pd_transfer.protocol.generations import FRESHNESS_RULES, Freshness, Handling, RoomGenerations
from pd_transfer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Close,
    Done,
    DoneStatus,
    Hello,
    Message,
    Register,
    RoomMessage,
    Verdict,
)
from pd_transfer.protocol.transitions import (
    TRANSITIONS,
    SessionState,
    allowed,
    trigger_of,
)
from pd_transfer.wire.fields import clip_text
from pd_transfer.wire.limits import DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class Dropped:
    """A received message that changed nothing, and why (``message`` None: undecodable)."""

    message: Message | None
    code: Reason
    text: str


class _Violation(Exception):
    def __init__(self, code: Reason, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text


class Session:
    """One end of a prefill-decode session; see the module docstring.

    ``our_role`` is this agent's role; the peer has the other one.
    ``their_hello``, ``their_register`` and ``verdict`` hold what the
    handshake established, for the agent to read.
    """

    def __init__(self, our_role: Role, *, limits: Limits = DEFAULT_LIMITS) -> None:
        if not isinstance(our_role, Role):
            raise LocalProtocolError(f"our_role must be a Role, got {our_role!r}", code=Reason.ROLE_MISMATCH)
        self.our_role = our_role
        self.their_role = Role.DECODE if our_role is Role.PREFILL else Role.PREFILL
        self.limits = limits
        self.generations = RoomGenerations()
        self.their_hello: Hello | None = None
        self.their_register: Register | None = None
        self.verdict: Verdict | None = None
        self._state = SessionState.IDLE
        self._failure: ProtocolError | None = None

    @property
    def state(self) -> SessionState:
        return self._state

    # -- public -----------------------------------------------------------------
    def send(self, message: Message) -> bytes:
        """Check ``message`` is legal for us now, record it, return its frame.

        In ``error`` only a Close may be sent: the reply of the
        :class:`RemoteProtocolError` that put the session there.
        """
        if self._state is SessionState.ERROR and isinstance(message, Close):
            return encode(message)
        self._refuse_if_failed()
        if self._state is SessionState.CLOSED:
            raise LocalProtocolError(
                f"cannot send {trigger_of(message).value}: the session is closed", code=Reason.SESSION_CLOSED
            )
        try:
            next_state = self._judge(message, self.our_role)
        except _Violation as violation:
            raise LocalProtocolError(violation.text, code=violation.code) from None
        if isinstance(message, RoomMessage):
            freshness = self.generations.classify(message)
            if freshness is not Freshness.FRESH:
                _, code = FRESHNESS_RULES[freshness]
                raise LocalProtocolError(self._freshness_text(message, freshness), code=code)
        frame = self._encode_checked(message)
        self._commit(message, next_state, received=False)
        return frame

    def receive_data(self, frame: bytes | bytearray | memoryview) -> Message | Dropped:
        """Decode a frame from the peer and :meth:`receive` it."""
        self._refuse_if_failed()
        try:
            message = decode(frame, self.limits)
        except ProtocolError as exc:
            if self._state is SessionState.CLOSED:
                return Dropped(
                    None, Reason.SESSION_CLOSED, f"undecodable frame after the session closed: {exc.message}"
                )
            raise self._fail_session(exc.code, exc.problem, exc.path) from None
        return self.receive(message)

    def receive(self, message: Message) -> Message | Dropped:
        """Check a decoded message from the peer against the tables, record it.

        The message object is trusted to be well-formed (it came from
        :func:`decode` or from in-process code); frames go through
        :meth:`receive_data`.
        """
        self._refuse_if_failed()
        if self._state is SessionState.CLOSED:
            return Dropped(
                message,
                Reason.SESSION_CLOSED,
                f"{trigger_of(message).value} arrived after the session closed",
            )
        try:
            next_state = self._judge(message, self.their_role)
        except _Violation as violation:
            raise self._fail_session(violation.code, violation.text) from None
        if isinstance(message, RoomMessage):
            freshness = self.generations.classify(message)
            handling, code = FRESHNESS_RULES[freshness]
            text = self._freshness_text(message, freshness)
            # code is None only where the message is delivered (FRESH)
            if handling is Handling.DROP and code is not None:
                return Dropped(message, code, text)
            if handling is Handling.VIOLATION and code is not None:
                raise RemoteProtocolError(text, code=code, reply=self._room_reply(message, code, text))
        self._commit(message, next_state, received=True)
        return message

    def forget_room(self, room: int) -> None:
        """The agent concluded ``room``; later messages about it are dropped as unknown."""
        self.generations.forget(room)

    # -- rules ------------------------------------------------------------------
    def _encode_checked(self, message: Message) -> bytes:
        """Encode, then decode our own frame: the peer will run exactly these checks,
        and a message it would refuse (a failed Done without a reason, a negative
        page index) is our bug, better caught here than as the peer's Close."""
        frame = encode(message)
        try:
            decode(frame, self.limits)
        except ProtocolError as exc:
            raise LocalProtocolError(
                f"refusing to send a frame the peer would reject: {exc.problem}", code=exc.code, path=exc.path
            ) from None
        return frame

    def _judge(self, message: Message, sender: Role) -> SessionState:
        """The state ``message`` from ``sender`` leads to; :class:`_Violation` if it is illegal."""
        trigger = trigger_of(message)
        next_state = TRANSITIONS.get((self._state, sender, trigger))
        if next_state is None:
            legal = ", ".join(f"{r.value} {t.value}" for r, t in allowed(self._state))
            raise _Violation(
                Reason.ILLEGAL_MESSAGE,
                f"{sender.value} may not send {trigger.value} in session state "
                f"{self._state.value}; allowed there: {legal}",
            )
        _check_content(message, sender)
        return next_state

    def _freshness_text(self, message: RoomMessage, freshness: Freshness) -> str:
        room, generation = message.room, message.generation
        current = self.generations.current(room)
        known = "no request" if current is None else f"current generation {current}"
        return (
            f"{trigger_of(message).value} for room {room} generation {generation} is "
            f"{freshness.value} ({known} on this session)"
        )

    def _room_reply(self, message: RoomMessage, code: Reason, text: str) -> Message:
        """Fail just this room, at the generation both sides agree on."""
        room = message.room
        # a duplicate or a future generation is judged against a current one, so there is one
        generation = self.generations.current(room)
        if generation is None:
            generation = message.generation
        text = clip_text(text)
        if self.our_role is Role.PREFILL:
            return Done(
                room=room, generation=generation, status=DoneStatus.FAILED, reason=code, reason_text=text
            )
        return Abort(room=room, generation=generation, reason=code, reason_text=text)

    # -- state ------------------------------------------------------------------
    def _commit(self, message: Message, next_state: SessionState, *, received: bool) -> None:
        self._state = next_state
        self.generations.record(message)
        if isinstance(message, Verdict):
            self.verdict = message
        elif received and isinstance(message, Hello):
            self.their_hello = message
        elif received and isinstance(message, Register):
            self.their_register = message

    def _fail_session(self, code: Reason, problem: str, path: str = "") -> RemoteProtocolError:
        error = RemoteProtocolError(problem, code=code, path=path)
        error.reply = Close(reason=code, reason_text=clip_text(error.message))
        self._state = SessionState.ERROR
        self._failure = error
        return error

    def _refuse_if_failed(self) -> None:
        if self._state is SessionState.ERROR:
            raise LocalProtocolError(
                f"the session failed earlier and must be torn down: "
                f"{self._failure.message if self._failure else ''}",
                code=Reason.SESSION_FAILED,
            )


def _check_content(message: Message, sender: Role) -> None:
    """Rules on a message's content that the session, not the codec, must enforce."""
    if isinstance(message, Hello):
        if message.role is not sender:
            raise _Violation(
                Reason.ROLE_MISMATCH, f"the {sender.value} end says hello as {message.role.value}"
            )
        if message.protocol_version[0] != PROTOCOL_VERSION[0]:
            major, minor = message.protocol_version
            raise _Violation(
                Reason.VERSION_UNSUPPORTED,
                f"peer speaks protocol {major}.{minor}, this agent speaks "
                f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}; major versions must match",
            )
    if isinstance(message, Done) and sender is Role.DECODE and message.status is not DoneStatus.SUCCESS:
        raise _Violation(
            Reason.ILLEGAL_MESSAGE,
            "decode may only send a successful Done (it confirms the bytes); a failure is an Abort",
        )
    if isinstance(message, Register) and message.geometry.role is not sender:
        raise _Violation(
            Reason.ROLE_MISMATCH, f"the {sender.value} end registers a {message.geometry.role.value} geometry"
        )
