"""A room's status only moves forward; Failed is sticky, Success is final."""

import pytest
from protocol_samples import ROOM, abort, done, failed_done, progress

from pd_transfer.errors import LocalProtocolError, Reason
from pd_transfer.protocol import ROOM_TRANSITIONS, RoomStatus
from pd_transfer.protocol import RoomGeneration as RoomState

ORDER = [RoomStatus.BOOTSTRAPPING, RoomStatus.WAITING_FOR_INPUT, RoomStatus.TRANSFERRING, RoomStatus.SUCCESS]


def test_status_moves_forward():
    state = RoomState(ROOM, 1)
    for status in ORDER[1:]:
        state = state.advance(status)
        assert state.status is status


@pytest.mark.parametrize("current", ORDER)
@pytest.mark.parametrize("requested", ORDER)
def test_lower_or_equal_status_is_ignored(current, requested):
    state = RoomState(ROOM, 1, current)
    after = state.advance(requested)
    if ORDER.index(requested) > ORDER.index(current) and current is not RoomStatus.SUCCESS:
        assert after.status is requested
    else:
        assert after is state


@pytest.mark.parametrize("current", ORDER[:-1])
def test_any_live_status_can_fail(current):
    state = RoomState(ROOM, 1, current).fail(Reason.TIMEOUT, "no Done within 30.0s")
    assert (state.status, state.reason, state.reason_text) == (
        RoomStatus.FAILED,
        Reason.TIMEOUT,
        "no Done within 30.0s",
    )


def test_failed_is_sticky_and_first_reason_wins():
    failed = RoomState(ROOM, 1).fail(Reason.PEER_LOST, "lost prefill-0")
    for status in ORDER:
        assert failed.advance(status) is failed
    assert failed.fail(Reason.TIMEOUT, "later timeout") is failed
    assert failed.apply(done()) is failed


def test_success_is_final_even_if_a_failure_arrives_later():
    success = RoomState(ROOM, 1, RoomStatus.TRANSFERRING).apply(done())
    assert success.status is RoomStatus.SUCCESS
    assert success.fail(Reason.ABORTED, "abort crossed the Done") is success
    assert success.apply(abort()) is success


def test_failure_needs_a_reason_and_text():
    with pytest.raises(LocalProtocolError):
        RoomState(ROOM, 1).fail(Reason.TIMEOUT, "")
    with pytest.raises(LocalProtocolError):
        RoomState(ROOM, 1).advance(RoomStatus.FAILED)


def test_messages_drive_the_status():
    state = RoomState(ROOM, 1, RoomStatus.WAITING_FOR_INPUT)
    state = state.apply(progress())
    assert state.status is RoomStatus.TRANSFERRING
    state = state.apply(progress())
    assert state.status is RoomStatus.TRANSFERRING
    failed = state.apply(failed_done())
    assert (failed.status, failed.reason) == (RoomStatus.FAILED, Reason.VIEW_OUT_OF_REGION)
    assert failed.reason_text == "page 9 is outside region kv.k.L0"


def test_progress_after_done_does_not_regress():
    state = RoomState(ROOM, 1).apply(done()).apply(progress())
    assert state.status is RoomStatus.SUCCESS


def test_messages_of_another_generation_are_ignored():
    state = RoomState(ROOM, 2, RoomStatus.WAITING_FOR_INPUT)
    assert state.apply(failed_done(generation=1)) is state
    assert state.apply(done(generation=3)) is state


def test_message_about_another_room_is_a_caller_bug():
    with pytest.raises(LocalProtocolError):
        RoomState(ROOM, 1).apply(done(room=ROOM + 1))


def test_table_has_terminal_success_and_failed_only():
    assert {s for s, moves in ROOM_TRANSITIONS.items() if not moves} == {
        RoomStatus.SUCCESS,
        RoomStatus.FAILED,
    }
    assert all(RoomStatus.FAILED in moves for s, moves in ROOM_TRANSITIONS.items() if moves)
