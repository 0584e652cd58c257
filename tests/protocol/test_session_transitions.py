"""The session table: every transition works, every other (state, message) is refused.

The table is pinned by a golden list written by hand from the protocol's
documented semantics (docs/protocol.md, "The session", and the messages'
purposes), not generated from TRANSITIONS: a wrong, missing or extra entry in
the table fails here. The behaviour tests below run over the golden list, so
they check what the protocol promises, whatever the table says.
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

S, T, P, D = SessionState, Trigger, Role.PREFILL, Role.DECODE

#: (state, sender, trigger) -> next state, as docs/protocol.md describes the session.
GOLDEN_LEGAL = {
    # The handshake: decode connects, so it speaks first; each step has one sender.
    (S.IDLE, D, T.HELLO): S.GREETING,
    (S.GREETING, P, T.HELLO): S.GREETED,
    (S.GREETED, D, T.REGISTER): S.REGISTERING,
    (S.REGISTERING, P, T.REGISTER): S.REGISTERED,
    (S.REGISTERED, P, T.VERDICT_ACCEPTED): S.ACCEPTED,
    (S.REGISTERED, P, T.VERDICT_REJECTED): S.REJECTED,
    # Rooms flow only once accepted: decode requests, prefill reports and finishes,
    # decode confirms a room it has the bytes of; either side aborts and acknowledges.
    (S.ACCEPTED, D, T.TRANSFER_REQUEST): S.ACCEPTED,
    (S.ACCEPTED, P, T.PROGRESS): S.ACCEPTED,
    (S.ACCEPTED, P, T.DONE): S.ACCEPTED,
    (S.ACCEPTED, D, T.DONE): S.ACCEPTED,
    (S.ACCEPTED, P, T.ABORT): S.ACCEPTED,
    (S.ACCEPTED, D, T.ABORT): S.ACCEPTED,
    (S.ACCEPTED, P, T.ABORT_ACK): S.ACCEPTED,
    (S.ACCEPTED, D, T.ABORT_ACK): S.ACCEPTED,
    # An accepted decode tells prefill of a room it gave up before claiming it.
    (S.ACCEPTED, D, T.ROOM_REFUSED): S.ACCEPTED,
    # Rejected: decode tells prefill each room it would have asked for, which fails too.
    (S.REJECTED, D, T.ROOM_REFUSED): S.REJECTED,
    # Heartbeats both ways once both agents know each other (from greeted on).
    (S.GREETED, P, T.HEARTBEAT): S.GREETED,
    (S.GREETED, D, T.HEARTBEAT): S.GREETED,
    (S.REGISTERING, P, T.HEARTBEAT): S.REGISTERING,
    (S.REGISTERING, D, T.HEARTBEAT): S.REGISTERING,
    (S.REGISTERED, P, T.HEARTBEAT): S.REGISTERED,
    (S.REGISTERED, D, T.HEARTBEAT): S.REGISTERED,
    (S.ACCEPTED, P, T.HEARTBEAT): S.ACCEPTED,
    (S.ACCEPTED, D, T.HEARTBEAT): S.ACCEPTED,
    (S.REJECTED, P, T.HEARTBEAT): S.REJECTED,
    (S.REJECTED, D, T.HEARTBEAT): S.REJECTED,
    # Either side may close in any non-terminal state.
    (S.IDLE, P, T.CLOSE): S.CLOSED,
    (S.IDLE, D, T.CLOSE): S.CLOSED,
    (S.GREETING, P, T.CLOSE): S.CLOSED,
    (S.GREETING, D, T.CLOSE): S.CLOSED,
    (S.GREETED, P, T.CLOSE): S.CLOSED,
    (S.GREETED, D, T.CLOSE): S.CLOSED,
    (S.REGISTERING, P, T.CLOSE): S.CLOSED,
    (S.REGISTERING, D, T.CLOSE): S.CLOSED,
    (S.REGISTERED, P, T.CLOSE): S.CLOSED,
    (S.REGISTERED, D, T.CLOSE): S.CLOSED,
    (S.ACCEPTED, P, T.CLOSE): S.CLOSED,
    (S.ACCEPTED, D, T.CLOSE): S.CLOSED,
    (S.REJECTED, P, T.CLOSE): S.CLOSED,
    (S.REJECTED, D, T.CLOSE): S.CLOSED,
}

#: Transitions the protocol forbids, each for a reason the docs state.
GOLDEN_ILLEGAL = [
    (S.IDLE, P, T.HELLO),  # decode speaks first
    (S.IDLE, D, T.HEARTBEAT),  # no heartbeat before both said hello
    (S.GREETING, D, T.HELLO),  # one hello each
    (S.GREETING, D, T.HEARTBEAT),
    (S.GREETING, D, T.REGISTER),  # register only after both hellos
    (S.GREETED, P, T.REGISTER),  # decode registers first
    (S.GREETED, P, T.VERDICT_ACCEPTED),  # no verdict before both geometries
    (S.REGISTERING, D, T.REGISTER),  # one register each
    (S.REGISTERING, P, T.VERDICT_ACCEPTED),
    (S.REGISTERED, D, T.VERDICT_ACCEPTED),  # only prefill gives the verdict
    (S.REGISTERED, D, T.VERDICT_REJECTED),
    (S.REGISTERED, D, T.TRANSFER_REQUEST),  # rooms only once accepted
    (S.REGISTERED, P, T.ABORT),
    (S.ACCEPTED, P, T.TRANSFER_REQUEST),  # only decode requests a room
    (S.ACCEPTED, D, T.PROGRESS),  # only prefill reports progress
    (S.ACCEPTED, P, T.VERDICT_ACCEPTED),  # one verdict per session
    (S.ACCEPTED, P, T.VERDICT_REJECTED),
    (S.ACCEPTED, D, T.HELLO),  # the handshake does not restart
    (S.ACCEPTED, P, T.REGISTER),
    (S.REJECTED, D, T.TRANSFER_REQUEST),  # rejected: only heartbeats and close
    (S.REJECTED, P, T.PROGRESS),
    (S.REJECTED, P, T.DONE),
    (S.REJECTED, D, T.ABORT),
    (S.ACCEPTED, P, T.ROOM_REFUSED),  # only decode knows the rooms it gives up
    (S.REJECTED, P, T.ROOM_REFUSED),  # only decode knows the rooms it would have claimed
    (S.REJECTED, P, T.VERDICT_ACCEPTED),
]

LIVE = [s for s in SessionState if s not in TERMINAL_STATES]
ILLEGAL = [
    (state, role, trigger)
    for state in LIVE
    for role in Role
    for trigger in Trigger
    if (state, role, trigger) not in GOLDEN_LEGAL
]


def _name(case):
    return "-".join(part.value for part in case)


def test_every_live_state_is_reachable_from_idle():
    for state in LIVE:
        assert SessionPair().drive_to(state).states == (state, state)


def test_table_has_no_exit_from_terminal_states():
    assert not [key for key in TRANSITIONS if key[0] in TERMINAL_STATES]


def test_table_is_exactly_the_documented_session():
    table = dict(TRANSITIONS)
    assert sorted(map(_name, table.keys() - GOLDEN_LEGAL.keys())) == [], "entries the docs forbid"
    assert sorted(map(_name, GOLDEN_LEGAL.keys() - table.keys())) == [], "documented, missing"
    wrong = [(_name(k), table[k].value, v.value) for k, v in GOLDEN_LEGAL.items() if table[k] is not v]
    assert wrong == [], "transitions to another state than documented"


def test_documented_illegal_transitions_are_absent_from_the_table():
    assert not set(GOLDEN_ILLEGAL) & GOLDEN_LEGAL.keys()  # the golden lists agree
    assert [_name(k) for k in GOLDEN_ILLEGAL if k in TRANSITIONS] == []


@pytest.mark.parametrize("key", list(GOLDEN_LEGAL), ids=_name)
def test_every_transition_moves_both_ends_to_the_same_state(key):
    state, sender, trigger = key
    pair = SessionPair().drive_to(state)
    if trigger in ROOM_TRIGGERS and trigger is not Trigger.TRANSFER_REQUEST:
        pair.deliver(Role.DECODE, transfer_request())  # the room the message is about
    message = message_for(trigger, sender)
    assert pair.deliver(sender, message) == message
    assert pair.states == (GOLDEN_LEGAL[key], GOLDEN_LEGAL[key])


@pytest.mark.parametrize("key", ILLEGAL, ids=_name)
def test_illegal_message_we_send_is_a_local_error_and_changes_nothing(key):
    state, sender, trigger = key
    pair = SessionPair().drive_to(state)
    with pytest.raises(LocalProtocolError) as caught:
        pair[sender].send(message_for(trigger, sender))
    assert caught.value.code is Reason.ILLEGAL_MESSAGE
    assert str(caught.value).startswith(
        f"{sender.value} may not send {trigger.value} in session state {state.value}; allowed there: "
    )
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
    assert str(caught.value) == (
        "prefill may not send register in session state idle; allowed "
        "there: decode hello, prefill close, decode close"
    )


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
    assert dropped == Dropped(
        message_for(Trigger.DONE, Role.PREFILL),
        Reason.SESSION_CLOSED,
        "done arrived after the session closed",
    )


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
        assert str(caught.value).startswith(
            "the session failed earlier and must be torn down: at $: not a valid msgpack frame"
        )


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
        ("decode", "hello"),
        ("prefill", "hello"),
        ("decode", "register"),
        ("prefill", "register"),
        ("prefill", "verdict_rejected"),
    ]


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
    assert str(caught.value) == (
        "at $.done.reason: refusing to send a frame the peer would reject: "
        "a failed Done must carry a reason code and text"
    )
    assert pair.states == (SessionState.ACCEPTED, SessionState.ACCEPTED)
