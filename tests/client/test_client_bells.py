"""The client's doorbell bookkeeping: what an expect reply offers, and what it may not."""

import logging

import pytest

from pd_transfer.client.bells import WorkerBells as RoomBells
from pd_transfer.memory import doorbell
from pd_transfer.memory.doorbell import Outcome

pytestmark = pytest.mark.skipif(not doorbell.AVAILABLE, reason="doorbells need Linux on x86-64")


@pytest.fixture
def segment(owned_doorbells):
    return owned_doorbells("test-client", 16)


def test_a_room_offered_a_doorbell_is_waited_for_on_it(segment):
    bells = RoomBells()
    slot, token = segment.arm()
    segment.set_writers(slot, token, 1)
    bells.note(
        5, {"status": "bootstrapping", "doorbell": {"segment": segment.name, "slot": slot, "token": token}}
    )
    assert bells.wait(5, 0.05) is Outcome.TIMEOUT
    assert segment.ring(slot, token, 0)
    assert bells.wait(5, 1.0) is Outcome.RUNG
    assert bells.wait(5, 1.0) is None  # rung rooms are forgotten: the sidecar answers later calls
    bells.close()


@pytest.mark.parametrize(
    "offer",
    [
        None,
        "pdt-x-doorbells-1",
        {"segment": 7, "slot": 1, "token": 1},
        {"segment": "s", "slot": "1", "token": 1},
        {"segment": "s", "slot": 1, "token": True},
    ],
)
def test_a_malformed_offer_leaves_the_room_to_messages(offer):
    bells = RoomBells()
    bells.note(5, {"doorbell": offer} if offer is not None else {})
    assert bells.wait(5, 0.0) is None


def test_a_slot_outside_the_segment_or_its_own_bell_is_refused(segment):
    bells = RoomBells()
    for slot in (0, segment.slots, -1):
        bells.note(5, {"doorbell": {"segment": segment.name, "slot": slot, "token": 1}})
        assert bells.wait(5, 0.0) is None
    bells.close()


def test_a_segment_that_cannot_be_mapped_is_reported_once(caplog):
    bells = RoomBells()
    caplog.set_level(logging.WARNING, logger="pd_transfer.client.bells")
    for room in (1, 2, 3):
        bells.note(room, {"doorbell": {"segment": "pdt-gone-doorbells-1-2-3", "slot": 1, "token": room}})
        assert bells.wait(room, 0.0) is None
    assert len([r for r in caplog.records if "cannot map" in r.getMessage()]) == 1


def test_rang_reads_the_bell_without_a_message(segment):
    from pd_transfer.client import Client

    client = Client("unix:///nonexistent/pdt-rang.sock", "w", secret=b"x" * 32)  # never connects
    slot, token = segment.arm()
    segment.set_writers(slot, token, 1)
    client._bells.note(5, {"doorbell": {"segment": segment.name, "slot": slot, "token": token}})
    assert client.rang(5) is False  # open, nothing decided
    assert client.rang(6) is None  # no doorbell: only the sidecar can tell
    assert segment.ring(slot, token, 0)
    assert client.rang(5) is True
    client.close()
