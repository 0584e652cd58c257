"""Admission (agent/admission.py): limits hold, waits are fair and bounded, rooms give back.

Pure asyncio: no sockets. Deadlines are a few hundredths of a second; no
assertion depends on how fast anything runs, only on the order of events.
"""

import asyncio
import time
from types import SimpleNamespace

import pytest

from pd_transfer.agent.admission import Admission, Limiter
from pd_transfer.agent.rooms import Room, RoomTable
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.protocol import RoomStatus

pytestmark = pytest.mark.asyncio
LATER = float("inf")


def _bytes(per_peer: int, total: int = 0) -> Limiter:
    return Limiter(
        "bytes", ("max_inflight_nbytes", per_peer), ("max_inflight_nbytes_total", total) if total else None
    )


def _rooms(per_peer: int) -> Limiter:
    return Limiter("rooms", ("max_rooms_per_peer", per_peer))


def _start(limiter: Limiter, peer: str, amount: int, room: int, deadline_s: float = LATER):
    return asyncio.ensure_future(limiter.acquire(peer, amount, room, deadline_s, what=f"room {room}"))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_rooms_over_the_per_peer_limit_wait_in_arrival_order():
    limiter = _rooms(2)
    tasks = [_start(limiter, "d0", 1, room) for room in range(5)]
    await _settle()
    assert [t.done() for t in tasks] == [True, True, False, False, False]
    assert limiter.in_use("d0") == 2 and limiter.num_waiting == 3
    tasks[1].result().release()
    await _settle()
    assert [t.done() for t in tasks] == [True, True, True, False, False]  # room 2, not 3 or 4
    tasks[0].result().release()
    tasks[0].result().release()  # idempotent: frees one slot only
    await _settle()
    assert [t.done() for t in tasks] == [True, True, True, True, False]
    assert limiter.in_use("d0") == 2 and limiter.peak == 2


async def test_a_wait_past_its_deadline_fails_with_backpressure_timeout_naming_the_limit():
    limiter = _rooms(1)
    timeouts = []
    limiter.on_timeout = lambda resource, limit, waited_s: timeouts.append((resource, limit))
    held = await limiter.acquire("decode-a", 1, 1, LATER, what="a room slot with decode-a")
    with pytest.raises(PdTransferError) as err:
        await limiter.acquire("decode-a", 1, 2, time.monotonic() + 0.05, what="a room slot with decode-a")
    assert err.value.code is Reason.BACKPRESSURE_TIMEOUT
    text = str(err.value)
    assert "for a room slot with decode-a: decode-a holds 1 room(s) of max_rooms_per_peer=1;" in text
    assert "raise max_rooms_per_peer or admission_wait_s" in text
    assert timeouts == [("rooms", "max_rooms_per_peer")]
    assert limiter.num_waiting == 0  # the expired waiter left the queue
    held.release()
    assert limiter.in_use("decode-a") == 0
    assert (await limiter.acquire("decode-a", 1, 3, LATER, what="x")).amount == 1


async def test_a_wait_blocked_by_the_total_names_the_total_limit():
    limiter = _bytes(per_peer=100, total=100)
    await limiter.acquire("a", 80, 1, LATER, what="80 B to a")
    with pytest.raises(PdTransferError) as err:
        await limiter.acquire("b", 40, 2, time.monotonic() + 0.02, what="40 B to b")
    assert "all peers hold 80 B of max_inflight_nbytes_total=100;" in str(err.value)


async def test_bytes_are_granted_round_robin_across_peers_under_the_total():
    limiter = _bytes(per_peer=1000, total=10)
    first = await limiter.acquire("a", 10, 0, LATER, what="x")
    order = []
    tasks = [_start(limiter, "a", 10, room) for room in (1, 2, 3)] + [
        _start(limiter, "b", 10, room) for room in (4, 5)
    ]
    for task, room in zip(tasks, (1, 2, 3, 4, 5), strict=True):
        task.add_done_callback(lambda t, r=room: order.append(r))
    grant = first
    for _ in range(5):
        await _settle()
        grant.release()
        await _settle()
        grant = next(t.result() for t in tasks if t.done() and not t.result().released)
    await _settle()
    assert order == [1, 4, 2, 5, 3]  # a, b, a, b, a: not all of a's first
    assert limiter.peak == 10  # never two in flight under a total of 10


async def test_a_request_larger_than_a_limit_is_admitted_alone():
    limiter = _bytes(per_peer=10, total=20)
    big = await limiter.acquire("a", 50, 1, LATER, what="50 B")  # nothing else in flight
    small = _start(limiter, "b", 1, 2)
    await _settle()
    assert not small.done()  # the total is held by the big one
    big.release()
    await _settle()
    assert small.done() and limiter.in_use_total == 1


async def test_a_big_request_is_not_overtaken_by_smaller_ones_of_other_peers():
    limiter = _bytes(per_peer=100, total=10)
    held = await limiter.acquire("a", 6, 1, LATER, what="x")
    big = _start(limiter, "b", 10, 2)  # waits for the whole total
    small = _start(limiter, "c", 2, 3)  # would fit now, but b is first in turn
    await _settle()
    assert not big.done() and not small.done()
    held.release()
    await _settle()
    assert big.done() and not small.done()
    big.result().release()
    await _settle()
    assert small.done()


async def test_a_peer_at_its_own_limit_does_not_block_the_others():
    limiter = _bytes(per_peer=4, total=100)
    await limiter.acquire("a", 4, 1, LATER, what="x")
    a_more = _start(limiter, "a", 4, 2)  # a is at its own limit
    b = _start(limiter, "b", 4, 3)
    await _settle()
    assert not a_more.done() and b.done()


async def test_a_room_that_ends_leaves_the_queue_and_gives_its_slots_back():
    admission = Admission(
        SimpleNamespace(
            admission_wait_s=5.0, max_rooms_per_peer=1, max_inflight_nbytes=100, max_inflight_nbytes_total=100
        )
    )
    first, second, third = Room(1, 0), Room(2, 0), Room(3, 0)
    await admission.admit_room("d0", first)
    waiting = asyncio.ensure_future(admission.admit_room("d0", second))
    queued = asyncio.ensure_future(admission.admit_room("d0", third))
    await _settle()
    second.fail(Reason.ABORTED, "aborted by the worker")  # ends while waiting
    await _settle()
    with pytest.raises(PdTransferError) as err:
        waiting.result()
    assert err.value.code is Reason.ABORTED
    assert not queued.done()
    first.advance(RoomStatus.SUCCESS)  # ends holding a slot: freed
    await _settle()
    assert queued.done() and queued.exception() is None
    assert admission.rooms.in_use("d0") == 1 and admission.rooms.num_waiting == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_a_late_grant_is_returned():
    limiter = _rooms(1)
    held = await limiter.acquire("d0", 1, 1, LATER, what="x")
    cancelled = _start(limiter, "d0", 1, 2)
    after = _start(limiter, "d0", 1, 3)
    await _settle()
    cancelled.cancel()
    await _settle()
    held.release()
    await _settle()
    assert after.done() and limiter.in_use("d0") == 1


async def test_the_wait_never_outlasts_the_room_deadline():
    admission = Admission(
        SimpleNamespace(
            admission_wait_s=60.0, max_rooms_per_peer=1, max_inflight_nbytes=1, max_inflight_nbytes_total=1
        )
    )
    room = Room(1, 0)
    room.deadline_s = time.monotonic() + 0.5
    assert admission.deadline_s(room) == room.deadline_s
    room.deadline_s = LATER
    assert admission.deadline_s(room) <= time.monotonic() + 60.0


async def test_a_room_runs_its_end_hooks_once():
    calls = []
    room = Room(7, 0)
    room.on_end.append(lambda r: calls.append(r.room))
    room.advance(RoomStatus.WAITING_FOR_INPUT)
    room.fail(Reason.TIMEOUT, "late")
    room.fail(Reason.ABORTED, "again")
    assert calls == [7]


async def test_a_wait_ends_at_its_timeout_or_when_the_room_ends_and_leaves_no_waiter():
    room = Room(3, 0)
    room.advance(RoomStatus.WAITING_FOR_INPUT)
    start = time.monotonic()
    await asyncio.wait_for(room.wait(0.05), 5)  # nothing happens: back at its timeout
    assert time.monotonic() - start >= 0.04 and not room.terminal and room.waiters == []
    waiting = asyncio.ensure_future(room.wait(60))
    await _settle()
    assert not waiting.done() and len(room.waiters) == 1
    room.advance(RoomStatus.SUCCESS)  # the room ends: the wait returns now
    await asyncio.wait_for(waiting, 1)
    assert room.waiters == []
    cancelled = asyncio.ensure_future(Room(4, 0).wait(60))
    await _settle()
    cancelled.cancel()  # the worker went away
    with pytest.raises(asyncio.CancelledError):
        await cancelled


async def test_the_room_table_keeps_at_most_max_rooms_finished_rooms():
    table = RoomTable(ttl_s=3600, max_rooms=8)
    for room_id in range(100):
        room = Room(room_id, 0)
        table.add(room)
        room.advance(RoomStatus.SUCCESS)
    assert len(table.rooms) <= 2 * 8
    assert 99 in table.rooms and 0 not in table.rooms  # the oldest finished go first
    live = Room(1000, 0)
    table.add(live)
    assert table.refusal(1001) == ""
    assert table.refusal(1000) == ""  # an existing live room is no new room


async def test_the_room_table_sweep_times_out_late_live_rooms_and_forgets_old_finished_ones():
    table = RoomTable(ttl_s=10, max_rooms=64)
    old, recent = Room(1, 0), Room(2, 0)
    late, on_time = Room(3, 0), Room(4, 0)
    for room in (old, recent, late, on_time):
        table.add(room)
    old.advance(RoomStatus.SUCCESS)
    recent.fail(Reason.ABORTED, "aborted")
    late.advance(RoomStatus.WAITING_FOR_INPUT, deadline_s=50.0)
    on_time.advance(RoomStatus.WAITING_FOR_INPUT, deadline_s=500.0)
    old.finished_s, recent.finished_s = 100.0, 195.0
    timed_out = []

    def on_timeout(room):
        timed_out.append(room.room)
        room.fail(Reason.TIMEOUT, "deadline passed")

    table.expire(200.0, on_timeout)
    assert timed_out == [3]  # finished rooms are never timed out
    assert sorted(table.rooms) == [2, 3, 4]  # 1 finished 100 s ago (ttl 10 s): gone
    assert late.status is RoomStatus.FAILED and [r.room for r in table.live()] == [4]
    late.finished_s = 200.0
    table.expire(211.0, on_timeout)  # the room that timed out ages out too
    assert sorted(table.rooms) == [4] and timed_out == [3]
    replaced = Room(4, 1)  # a live room started over, then finished
    table.add(replaced)
    replaced.advance(RoomStatus.SUCCESS)
    replaced.finished_s = 300.0
    table.expire(311.0, on_timeout)
    assert table.rooms == {} and table.live() == [] and timed_out == [3]


async def test_the_room_table_counts_live_rooms_as_they_start_end_and_are_replaced():
    table = RoomTable(ttl_s=3600, max_rooms=2)
    first, second = Room(1, 0), Room(2, 0)
    table.add(first)
    table.add(second)
    assert "2 rooms are live, the limit is max_rooms=2" in table.refusal(3)
    first.advance(RoomStatus.SUCCESS)
    assert table.refusal(3) == "" and table.live() == [second]
    again = Room(2, 1)  # room 2 started over (a new generation) while live
    table.add(again)
    second.fail(Reason.ABORTED, "the old generation ends after its replacement")
    assert table.live() == [again]  # the old one's end does not drop the new one
    table.add(Room(4, 0))
    assert table.refusal(5) != "" and table.refusal(4) == ""
    again.fail(Reason.TIMEOUT, "timed out")
    assert [r.room for r in table.live()] == [4] and table.refusal(5) == ""


async def test_a_waiter_cancelled_just_before_its_grant_is_skipped_not_granted():
    limiter = _rooms(1)
    held = await limiter.acquire("d0", 1, 1, LATER, what="x")
    cancelled, after = _start(limiter, "d0", 1, 2), _start(limiter, "d0", 1, 3)
    await _settle()
    cancelled.cancel()
    held.release()  # in the same step: the cancelled one's task has not run yet
    await _settle()
    assert cancelled.cancelled() and after.done() and limiter.in_use("d0") == 1
