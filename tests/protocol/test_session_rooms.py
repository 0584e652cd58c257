"""Room messages on a session: generations decide fresh, stale, unknown or wrong."""

import pytest
from protocol_samples import ROOM, abort, abort_ack, done, failed_done, progress, transfer_request
from session_pair import SessionPair

from pd_transfer.errors import LocalProtocolError, Reason, RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import (
    FRESHNESS_RULES,
    MESSAGE_TYPES,
    Abort,
    Done,
    DoneStatus,
    Dropped,
    Freshness,
    RoomMessage,
    SessionState,
    encode,
    trigger_of,
)
from pd_transfer.protocol.messages import ROOM_MESSAGES
from pd_transfer.protocol.transitions import ROOM_TRIGGERS

P, D = Role.PREFILL, Role.DECODE


@pytest.fixture
def pair():
    return SessionPair().drive_to(SessionState.ACCEPTED)


def test_every_freshness_has_a_rule():
    assert set(FRESHNESS_RULES) == set(Freshness)


def test_the_room_messages_are_the_messages_the_room_triggers_fire():
    """The session judges generations on every RoomMessage; the transition table names
    the same messages ROOM_TRIGGERS. The two lists must be one."""
    room_types = {t.cls for t in MESSAGE_TYPES.values() if issubclass(t.cls, RoomMessage)}
    assert room_types == set(ROOM_MESSAGES)
    samples = [transfer_request(), progress(), done(), abort(), abort_ack()]
    assert {type(m) for m in samples} == room_types
    assert {trigger_of(m) for m in samples} == ROOM_TRIGGERS


@pytest.mark.parametrize(
    "make, sender", [(progress, P), (done, P), (abort, P), (abort, D), (abort_ack, P), (abort_ack, D)]
)
def test_message_of_an_older_generation_is_dropped_as_stale(pair, make, sender):
    pair.deliver(D, transfer_request(generation=1))
    pair.deliver(D, transfer_request(generation=2))  # retried after an abort
    dropped = pair.peer(sender).receive_data(encode(make(generation=1)))
    assert isinstance(dropped, Dropped)
    assert dropped.code is Reason.STALE_GENERATION
    assert dropped.text == (
        f"{make(generation=1).TAG} for room {ROOM} generation 1 is stale "
        f"(current generation 2 on this session)"
    )
    assert pair.states == (SessionState.ACCEPTED, SessionState.ACCEPTED)


def test_stale_transfer_request_is_dropped(pair):
    pair.deliver(D, transfer_request(generation=3))
    dropped = pair[P].receive_data(encode(transfer_request(generation=2)))
    assert dropped.code is Reason.STALE_GENERATION


@pytest.mark.parametrize("make, sender", [(progress, P), (done, P), (abort, D), (abort_ack, P)])
def test_message_about_an_unknown_room_is_dropped(pair, make, sender):
    dropped = pair.peer(sender).receive_data(encode(make(room=99)))
    assert dropped.code is Reason.UNKNOWN_ROOM
    assert dropped.text.endswith("is unknown_room (no request on this session)")


def test_forgotten_room_is_unknown(pair):
    pair.deliver(D, transfer_request())
    pair.deliver(P, done())
    pair[D].forget_room(ROOM)
    assert pair[D].receive_data(encode(done())).code is Reason.UNKNOWN_ROOM


def test_current_generation_messages_are_delivered(pair):
    pair.deliver(D, transfer_request(generation=4))
    for sender, message in (
        (P, progress(generation=4)),
        (D, abort(generation=4)),
        (P, abort_ack(generation=4)),
        (P, failed_done(generation=4)),
    ):
        assert pair.deliver(sender, message) == message


def test_duplicate_request_fails_only_that_room_with_a_done_reply(pair):
    pair.deliver(D, transfer_request())
    with pytest.raises(RemoteProtocolError) as caught:
        pair[P].receive_data(encode(transfer_request()))
    error = caught.value
    assert error.code is Reason.DUPLICATE_ROOM
    assert error.reply == Done(
        room=ROOM,
        generation=1,
        status=DoneStatus.FAILED,
        reason=Reason.DUPLICATE_ROOM,
        reason_text=str(error),
    )
    assert pair[P].state is SessionState.ACCEPTED
    assert pair[D].receive_data(pair[P].send(error.reply)) == error.reply  # fresh for decode


def test_future_generation_fails_the_room_at_the_agreed_generation(pair):
    pair.deliver(D, transfer_request(generation=1))
    with pytest.raises(RemoteProtocolError) as caught:
        pair[D].receive_data(encode(progress(generation=5)))
    error = caught.value
    assert error.code is Reason.BAD_GENERATION
    assert str(error) == (
        f"progress for room {ROOM} generation 5 is future (current generation 1 on this session)"
    )
    assert error.reply == Abort(room=ROOM, generation=1, reason=Reason.BAD_GENERATION, reason_text=str(error))
    assert pair[P].receive_data(pair[D].send(error.reply)) == error.reply  # fresh for prefill
    assert pair.states == (SessionState.ACCEPTED, SessionState.ACCEPTED)


@pytest.mark.parametrize(
    "make, sender, code",
    [
        (lambda: progress(generation=1), P, Reason.STALE_GENERATION),
        (lambda: transfer_request(generation=2), D, Reason.DUPLICATE_ROOM),
        (lambda: abort(generation=9), D, Reason.BAD_GENERATION),
        (lambda: done(room=99), P, Reason.UNKNOWN_ROOM),
    ],
)
def test_sending_a_room_message_that_is_not_fresh_is_a_local_error(pair, make, sender, code):
    pair.deliver(D, transfer_request(generation=2))
    with pytest.raises(LocalProtocolError) as caught:
        pair[sender].send(make())
    assert caught.value.code is code


def test_abort_and_retry_with_a_new_generation(pair):
    pair.deliver(D, transfer_request(generation=1))
    pair.deliver(D, abort(generation=1))
    assert pair.deliver(P, abort_ack(generation=1)).drained
    pair.deliver(D, transfer_request(generation=2))
    late = pair[D].receive_data(encode(failed_done(generation=1)))
    assert late.code is Reason.STALE_GENERATION
    assert pair.deliver(P, done(generation=2)) == done(generation=2)


def test_rooms_are_independent(pair):
    pair.deliver(D, transfer_request(room=1, generation=1))
    pair.deliver(D, transfer_request(room=2, generation=7))
    assert pair.deliver(P, done(room=1, generation=1)) == done(room=1, generation=1)
    assert pair.deliver(P, done(room=2, generation=7)) == done(room=2, generation=7)
