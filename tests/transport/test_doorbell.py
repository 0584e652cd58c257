"""Doorbells on real shared memory and real futexes, rung from another process."""

import subprocess
import sys
import threading
import time

import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory import doorbell
from pd_transfer.memory.doorbell import MAX_WRITERS, Doorbells, Outcome
from pd_transfer.memory.segments import create_segment, segment_name

pytestmark = pytest.mark.skipif(not doorbell.AVAILABLE, reason="doorbells need Linux on x86-64")


@pytest.fixture
def bells(owned_doorbells):
    return owned_doorbells("test-decode", 64)


def _ring_from_another_process(name: str, slot: int, token: int, writer: int, delay_s: float = 0.0):
    code = (
        "import sys, time; from pd_transfer.memory.doorbell import Doorbells\n"
        f"time.sleep({delay_s}); b = Doorbells.open({name!r})\n"
        f"sys.exit(0 if b.ring({slot}, {token}, {writer}) else 3)"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_room_rings_only_when_every_writer_has(bells):
    slot, token = bells.arm()
    bells.set_writers(slot, token, 2)
    peer = Doorbells.open(bells.name)
    assert peer.ring(slot, token, 0)
    assert not bells.rung(slot, token)
    assert peer.wait(slot, token, 0.05) is Outcome.TIMEOUT
    assert peer.ring(slot, token, 1)
    assert bells.rung(slot, token)
    assert peer.wait(slot, token, 0.05) is Outcome.RUNG
    peer.close()


def test_a_sleeping_waiter_wakes_when_another_process_rings(bells):
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    ringer = _ring_from_another_process(bells.name, slot, token, 0, delay_s=0.5)
    started = time.monotonic()
    cpu = time.thread_time()
    outcome = bells.wait(slot, token, 30.0)
    woke, spent = time.monotonic() - started, time.thread_time() - cpu
    assert ringer.wait(10) == 0
    assert outcome is Outcome.RUNG
    assert 0.3 < woke < 10.0
    assert spent < 0.1, f"the waiter used {spent:.3f} s of CPU while it slept"  # no busy-waiting


def test_the_sidecar_and_the_worker_agree_on_who_came_first(bells):
    # every writer rang before the sidecar closed the slot: success on both sides
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    assert bells.ring(slot, token, 0)
    assert bells.close_slot(slot, token) is True
    # the sidecar closed first (it fails the room): a ring after that is not a success
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    assert bells.close_slot(slot, token) is False
    assert bells.ring(slot, token, 0)
    assert bells.wait(slot, token, 1.0) is Outcome.CLOSED


def test_a_closed_slot_wakes_its_waiter(bells):
    slot, token = bells.arm()
    closer = threading.Timer(0.2, bells.close_slot, (slot, token))
    closer.start()
    assert bells.wait(slot, token, 10.0) is Outcome.CLOSED
    closer.join()


def test_rings_for_anything_but_the_armed_room_write_nothing(bells):
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    before = bells.words.copy()
    assert not bells.ring(slot, token + 1, 0)  # a stale or forged token
    assert not bells.ring(bells.slots, token, 0)  # past the segment
    assert not bells.ring(-1, token, 0)
    assert not bells.ring(slot, token, MAX_WRITERS)  # past the slot
    assert (bells.words[:, 1:] == before[:, 1:]).all()  # bells may move, nothing else
    ringer = _ring_from_another_process(bells.name, slot, token + 1, 0)
    assert ringer.wait(10) == 3
    assert not bells.rung(slot, token)


def test_a_slot_armed_again_sends_the_old_rooms_waiter_to_the_sidecar(bells):
    slot, token = bells.arm()
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(bells.wait(slot, token, 30.0)))
    waiter.start()
    time.sleep(0.2)  # asleep on the slot when it is armed for another room
    for _ in range(bells.slots - 2):  # slot 0 is never armed
        bells.arm()
    started = time.monotonic()
    again, newer = bells.arm()
    waiter.join(10)
    assert again == slot and newer != token
    assert outcome == [Outcome.CLOSED] and time.monotonic() - started < 10
    assert not bells.ring(slot, token, 0)


def test_a_wait_times_out(bells):
    slot, token = bells.arm()
    started = time.monotonic()
    assert bells.wait(slot, token, 0.2) is Outcome.TIMEOUT
    assert 0.15 < time.monotonic() - started < 5


def test_the_segment_bell_moves_with_every_slot(bells):
    slot, token = bells.arm()
    bells.set_writers(slot, token, 1)
    woke = []
    sleeper = threading.Thread(
        target=lambda: (bells.sleep(0, bells.bell(), 30.0), woke.append(time.monotonic()))
    )
    sleeper.start()
    time.sleep(0.2)
    rang = time.monotonic()
    assert bells.ring(slot, token, 0)
    sleeper.join(10)
    assert woke and woke[0] - rang < 5


def test_no_writer_count_yet_is_never_rung(bells):
    slot, token = bells.arm()
    assert bells.ring(slot, token, 0)
    assert not bells.rung(slot, token)  # how many write this room is not known yet
    bells.set_writers(slot, token, 1)
    assert bells.rung(slot, token)


def test_only_a_doorbell_segment_is_mapped_as_one(bells):
    pool = create_segment(segment_name("test-worker", "kv.k.L0"), 1 << 16)  # zeroed, like a fresh pool
    try:
        with pytest.raises(TransportError) as caught:
            Doorbells.open(pool.name)
        assert caught.value.code is Reason.SEGMENT_NAME_INVALID and "doorbell" in str(caught.value)
        # and a zeroed slot (owner 0) never takes a ring: tokens start at 1
        as_bells = Doorbells(pool)
        assert not as_bells.ring(1, 0, 0)
        assert not pool.array.any()
    finally:
        pool.unlink()
        pool.close()
