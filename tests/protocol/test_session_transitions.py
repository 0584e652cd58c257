"""The session table: every transition works, every other (state, message) is refused.

The legal and illegal sets are both generated from TRANSITIONS, so a change to
the table is tested without touching this file.
"""

import pytest
from protocol_samples import hello, message_for, register, transfer_request
from session_pair import SessionPair, path_to

from pd_transfer.errors import LocalProtocolError, Reason, RemoteProtocolError
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import (
    TRANSITIONS,
    Close,
    Done,
    DoneStatus,
    Dropped,
    Hello,
    Session,
    SessionState,
    Trigger,
    decode,
    encode,
)
from pd_transfer.protocol.transitions import ROOM_TRIGGERS, TERMINAL_STATES

LIVE = [s for s in SessionState if s not in TERMINAL_STATES]
ILLEGAL = [(state, role, trigger) for state in LIVE for role in Role for trigger in Trigger
           if (state, role, trigger) not in TRANSITIONS]


def _name(case):
    return "-".join(part.value for part in case)


def test_every_live_state_is_reachable_from_idle():
    for state in LIVE:
        assert SessionPair().drive_to(state).states == (state, state)


def test_table_has_no_exit_from_terminal_states():
    assert not [key for key in TRANSITIONS if key[0] in TERMINAL_STATES]


@pytest.mark.parametrize("key", list(TRANSITIONS), ids=_name)
def test_every_transition_moves_both_ends_to_the_same_state(key):
    state, sender, trigger = key
    pair = SessionPair().drive_to(state)
    if trigger in ROOM_TRIGGERS and trigger is not Trigger.TRANSFER_REQUEST:
        pair.deliver(Role.DECODE, transfer_request())  # the room the message is about
    message = message_for(trigger, sender)
    assert pair.deliver(sender, message) == message
    assert pair.states == (TRANSITIONS[key], TRANSITIONS[key])


@pytest.mark.parametrize("key", ILLEGAL, ids=_name)
def test_illegal_message_we_send_is_a_local_error_and_changes_nothing(key):
    state, sender, trigger = key
    pair = SessionPair().drive_to(state)
    with pytest.raises(LocalProtocolError) as caught:
        pair[sender].send(message_for(trigger, sender))
    assert caught.value.code is Reason.ILLEGAL_MESSAGE
    assert str(caught.value).startswith(
        f"{sender.value} may not send {trigger.value} in session state {state.value}; allowed there: ")
    assert pair.states == (state, state)


@pytest.mark.parametrize("key", ILLEGAL, ids=_name)
def test_illegal_message_the_peer_sends_is_a_remote_error_with_a_close_reply(key):
    state, sender, trigger = key
    pair = SessionPair().drive_to(state)
    receiver = pair.peer(sender)
    frame = encode(message_for(trigger, sender))  # a misbehaving peer skips its own checks
    with pytest.raises(RemoteProtocolError) as caught:
        receiver.receive_data(frame)
    error = caught.value
    assert error.code is Reason.ILLEGAL_MESSAGE
    assert error.reply == Close(reason=Reason.ILLEGAL_MESSAGE, reason_text=str(error))
    assert receiver.state is SessionState.ERROR
    assert decode(receiver.send(error.reply)) == error.reply  # the reply can still go out


def test_illegal_message_text_names_what_is_allowed():
    pair = SessionPair()
    with pytest.raises(LocalProtocolError) as caught:
        pair[Role.PREFILL].send(register(Role.PREFILL))
    assert str(caught.value) == ("prefill may not send register in session state idle; allowed "
                                 "there: decode hello, prefill close, decode close")


@pytest.mark.parametrize("trigger", list(Trigger), ids=lambda t: t.value)
@pytest.mark.parametrize("sender", list(Role), ids=lambda r: r.value)
def test_after_close_sends_are_refused_and_receives_dropped(sender, trigger):
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    pair.deliver(Role.DECODE, Close())
    assert pair.states == (SessionState.CLOSED, SessionState.CLOSED)
    with pytest.raises(LocalProtocolError) as caught:
        pair[sender].send(message_for(trigger, sender))
    assert caught.value.code is Reason.SESSION_CLOSED
    dropped = pair.peer(sender).receive_data(encode(message_for(trigger, sender)))
    assert isinstance(dropped, Dropped) and dropped.code is Reason.SESSION_CLOSED


def test_frame_crossing_our_close_is_dropped_not_an_error():
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    pair.deliver(Role.DECODE, transfer_request())
    late_done = pair[Role.PREFILL].send(message_for(Trigger.DONE, Role.PREFILL))
    pair[Role.DECODE].send(Close())  # decode closes before the Done arrives
    dropped = pair[Role.DECODE].receive_data(late_done)
    assert dropped == Dropped(message_for(Trigger.DONE, Role.PREFILL), Reason.SESSION_CLOSED,
                              "done arrived after the session closed")


def test_undecodable_frame_after_close_is_dropped():
    pair = SessionPair().drive_to(SessionState.GREETED)
    pair.deliver(Role.PREFILL, Close())
    dropped = pair[Role.DECODE].receive_data(b"\xc1")
    assert dropped.message is None and dropped.code is Reason.SESSION_CLOSED


@pytest.mark.parametrize("trigger", list(Trigger), ids=lambda t: t.value)
def test_after_a_protocol_error_every_call_fails_fast(trigger):
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    decode_end = pair[Role.DECODE]
    with pytest.raises(RemoteProtocolError):
        decode_end.receive_data(b"\xc1")
    assert decode_end.state is SessionState.ERROR
    calls = {
        "send": lambda: decode_end.send(message_for(trigger, Role.DECODE)),
        "receive_data": lambda: decode_end.receive_data(encode(message_for(trigger, Role.PREFILL))),
        "receive": lambda: decode_end.receive(message_for(trigger, Role.PREFILL)),
    }
    for name, call in calls.items():
        if name == "send" and trigger is Trigger.CLOSE:
            assert decode(call()) == Close()  # the Close reply may still go out
            continue
        with pytest.raises(LocalProtocolError) as caught:
            call()
        assert caught.value.code is Reason.SESSION_FAILED
        assert str(caught.value).startswith("the session failed earlier and must be torn down: "
                                            "at $: not a valid msgpack frame")


def test_bad_frame_fails_the_session_with_the_decoders_reason_and_path():
    pair = SessionPair().drive_to(SessionState.GREETED)
    frame = encode(register(Role.DECODE)).replace(b"bfloat16", b"bfloat17")
    with pytest.raises(RemoteProtocolError) as caught:
        pair[Role.PREFILL].receive_data(frame)
    error = caught.value
    assert error.code is Reason.BAD_FIELD
    assert error.path == "$.register.geometry.views[0].dtype"
    assert error.reply.reason is Reason.BAD_FIELD
    assert error.reply.reason_text.startswith("at $.register.geometry.views[0].dtype: expected one of")


def test_hello_with_the_wrong_role_is_a_role_mismatch():
    session = Session(Role.PREFILL)
    with pytest.raises(RemoteProtocolError) as caught:
        session.receive_data(encode(hello(Role.PREFILL)))
    assert caught.value.code is Reason.ROLE_MISMATCH
    assert str(caught.value) == "the decode end says hello as prefill"


def test_register_with_the_other_roles_geometry_is_a_role_mismatch():
    pair = SessionPair().drive_to(SessionState.GREETED)
    with pytest.raises(LocalProtocolError) as caught:
        pair[Role.DECODE].send(register(Role.PREFILL))
    assert caught.value.code is Reason.ROLE_MISMATCH
    assert str(caught.value) == "the decode end registers a prefill geometry"


def test_hello_claiming_another_major_version_is_refused():
    session = Session(Role.PREFILL)
    claim = Hello(agent_id="d", role=Role.DECODE, protocol_version=(2, 0))
    with pytest.raises(RemoteProtocolError) as caught:
        session.receive(claim)
    assert caught.value.code is Reason.VERSION_UNSUPPORTED
    assert isinstance(caught.value.reply, Close)


def test_handshake_records_what_each_end_learned():
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    prefill, decode_end = pair[Role.PREFILL], pair[Role.DECODE]
    assert prefill.their_hello == hello(Role.DECODE)
    assert decode_end.their_register == register(Role.PREFILL)
    assert prefill.their_register == register(Role.DECODE)
    assert decode_end.verdict == prefill.verdict and decode_end.verdict.accepted


def test_path_to_rejected_is_the_documented_handshake():
    assert [(r.value, t.value) for r, t in path_to(SessionState.REJECTED)] == [
        ("decode", "hello"), ("prefill", "hello"), ("decode", "register"),
        ("prefill", "register"), ("prefill", "verdict_rejected")]


def test_non_message_is_a_local_error():
    with pytest.raises(LocalProtocolError) as caught:
        Session(Role.DECODE).send("hello")  # type: ignore[arg-type]
    assert caught.value.code is Reason.UNKNOWN_MESSAGE


def test_sending_a_message_the_peer_would_reject_is_a_local_error():
    pair = SessionPair().drive_to(SessionState.ACCEPTED)
    pair.deliver(Role.DECODE, transfer_request())
    broken = Done(room=7, generation=1, status=DoneStatus.FAILED)  # no reason
    with pytest.raises(LocalProtocolError) as caught:
        pair[Role.PREFILL].send(broken)
    assert caught.value.code is Reason.BAD_FIELD
    assert str(caught.value) == ("at $.done.reason: refusing to send a frame the peer would reject: "
                                 "a failed Done must carry a reason code and text")
    assert pair.states == (SessionState.ACCEPTED, SessionState.ACCEPTED)
