"""The loss verdict for a peer, and the stalls of our own loop it leaves out."""

import logging
from dataclasses import dataclass

import pytest

from pd_transfer.agent.liveness import LoopStalls, why_lost


@dataclass
class Peer:
    last_heard_s: float
    disconnected_s: float | None = None


def stalls(*spans, tick=0.1, keep=10.0):
    """LoopStalls that recorded a stall from ``a`` to ``b`` per span (a tick due at ``a``)."""
    record = LoopStalls(tick_s=tick, keep_s=keep, warn_s=0.5)
    for a, b in spans:
        record.tick(a - tick, b)
    return record


def test_lateness_under_a_tick_is_noise_and_over_it_a_stall():
    record = LoopStalls(tick_s=0.1, keep_s=10.0, warn_s=0.5)
    assert record.tick(0.0, 0.19) == 0.0  # 0.09 s late: not recorded
    assert record.within(0.0, 1.0) == 0.0
    assert record.tick(1.0, 1.6) == pytest.approx(0.5)
    assert record.within(0.0, 5.0) == pytest.approx(0.5)  # from 1.1 (expected wake) to 1.6
    assert record.within(1.3, 5.0) == pytest.approx(0.3)  # only the part inside the window
    assert record.within(1.6, 5.0) == 0.0
    assert record.total_s == pytest.approx(0.5)


def test_stalls_older_than_keep_are_forgotten():
    record = stalls((1.0, 2.0), keep=3.0)
    record.tick(4.0, 4.1)  # on time, but the clock moved on
    assert record.within(0.0, 10.0) == pytest.approx(1.0)
    record.tick(5.5, 5.6)  # 2.0 is now more than 3 s ago
    assert record.within(0.0, 10.0) == 0.0


def test_a_long_stall_is_logged(caplog):
    record = LoopStalls(tick_s=0.1, keep_s=10.0, warn_s=0.5)
    with caplog.at_level(logging.WARNING, logger="pd_transfer.agent.liveness"):
        record.tick(0.0, 0.35)  # 0.25 s late: recorded, not logged
        assert caplog.records == []
        record.tick(1.0, 1.9)
    assert "event loop stalled for 0.80 s" in caplog.text


def test_silence_counts_only_while_this_loop_could_listen():
    peer = Peer(last_heard_s=0.0)
    own = stalls((0.3, 1.3))  # stalled from 0.3 to 1.3
    assert why_lost(peer, 1.35, 0.2, 1.0) == "no heartbeat for 1.4 s"  # the old verdict
    assert why_lost(peer, 1.35, 0.2, 1.0, own) == ""  # awake only 0.35 s of it
    # a peer that stays silent is still lost, once it was silent for the limit while we listened
    assert why_lost(peer, 2.0, 0.2, 1.0, own) == ""
    assert (
        why_lost(peer, 2.2, 0.2, 1.0, own)
        == "no heartbeat for 2.2 s, 1.0 s of it while this sidecar was stalled"
    )


def test_a_closed_connection_counts_only_while_this_loop_could_listen():
    peer = Peer(last_heard_s=0.9, disconnected_s=1.0)
    own = stalls((1.2, 1.5))  # stalled from 1.2 to 1.5
    assert why_lost(peer, 1.5, 0.2, 10.0, own) == ""
    assert why_lost(peer, 1.5, 0.2, 10.0).startswith("its connection closed 0.5 s ago")
    assert why_lost(peer, 1.7, 0.2, 10.0, own).startswith("its connection closed 0.7 s ago")
