"""The loss verdict for a peer: gone or only slow, and the stalls it leaves out."""

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from pd_transfer.agent.liveness import LoopStalls, why_lost
from pd_transfer.agent.peer_process import ProcessIdentity, ProcessState, own_identity, peer_identity


@dataclass
class Peer:
    last_heard_s: float
    disconnected_s: float | None = None
    watched: bool = False
    peer_process: ProcessIdentity | None = None
    peer_stall_s: float = 0.0


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


# -- gone or slow: the peer's process on this host, and the stalls it reports -------------


@pytest.fixture
def child():
    """A live child process (a peer's stand-in), killed after the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def _state_becomes(identity: ProcessIdentity, state: ProcessState) -> ProcessState:
    deadline = time.monotonic() + 10  # a signal takes effect shortly after it is sent
    while identity.state() is not state and time.monotonic() < deadline:
        time.sleep(0.01)
    return identity.state()


def test_a_peer_process_is_running_stopped_or_gone_as_proc_says(child):
    me = own_identity()
    assert me is not None and me.state() is ProcessState.RUNNING
    identity = peer_identity(child.pid, _start_ticks(child.pid), "host-a", "host-a")
    assert identity is not None and identity.state() is ProcessState.RUNNING
    os.kill(child.pid, signal.SIGSTOP)
    assert _state_becomes(identity, ProcessState.STOPPED) is ProcessState.STOPPED
    os.kill(child.pid, signal.SIGCONT)
    assert _state_becomes(identity, ProcessState.RUNNING) is ProcessState.RUNNING
    child.kill()
    child.wait()
    assert identity.state() is ProcessState.GONE


def test_a_peer_process_is_watched_only_on_this_host_and_when_visible(child):
    ticks = _start_ticks(child.pid)
    assert peer_identity(child.pid, ticks, "host-b", "host-a") is None  # another host
    assert peer_identity(0, 0, "host-a", "host-a") is None  # it named no process
    # another pid namespace: the pid is not this process here (its start time differs)
    assert peer_identity(child.pid, ticks + 1, "host-a", "host-a") is None
    # a pid reused by a later process is not the peer
    assert ProcessIdentity(child.pid, ticks + 1).state() is ProcessState.GONE


def _start_ticks(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])


class Probed:
    """A ProcessIdentity stand-in whose state the test sets."""

    def __init__(self, state: ProcessState) -> None:
        self.pid, self._state = 4242, state

    def state(self) -> ProcessState:
        return self._state


def test_a_peer_whose_process_ended_is_lost_at_once_however_recent_its_heartbeat():
    peer = Peer(last_heard_s=1.0, peer_process=Probed(ProcessState.GONE))
    assert why_lost(peer, 1.01, 0.2, 1.0, slow_limit_s=30.0) == "its process (pid 4242 on this host) ended"


def test_a_running_peer_on_this_host_is_slow_not_gone_until_the_slow_limit():
    peer = Peer(last_heard_s=0.0, peer_process=Probed(ProcessState.RUNNING))
    assert why_lost(peer, 5.0, 0.2, 1.0, slow_limit_s=30.0) == ""  # 5 x the heartbeat limit
    assert why_lost(peer, 30.5, 0.2, 1.0, slow_limit_s=30.0) == (
        "no heartbeat for 30.5 s, though its process (pid 4242 on this host) runs: hung or starved that long"
    )


def test_a_stopped_peer_on_this_host_is_lost_after_the_heartbeat_limit():
    peer = Peer(last_heard_s=0.0, peer_process=Probed(ProcessState.STOPPED))
    assert why_lost(peer, 0.9, 0.2, 1.0, slow_limit_s=30.0) == ""
    assert why_lost(peer, 1.1, 0.2, 1.0, slow_limit_s=30.0) == (
        "no heartbeat for 1.1 s, its process (pid 4242 on this host) is stopped"
    )


def test_a_remote_peer_gets_the_stalls_its_heartbeats_reported_up_to_the_slow_limit():
    peer = Peer(last_heard_s=0.0, peer_stall_s=1.5)
    assert why_lost(peer, 2.4, 0.2, 1.0, slow_limit_s=30.0) == ""  # 1 s limit + 1.5 s it reported
    assert why_lost(peer, 2.6, 0.2, 1.0, slow_limit_s=30.0) == (
        "no heartbeat for 2.6 s (1.5 s more allowed for the stalls it reported)"
    )
    boasting = Peer(last_heard_s=0.0, peer_stall_s=1e9)  # a report is capped by the slow limit
    assert why_lost(boasting, 5.0, 0.2, 1.0, slow_limit_s=4.0).startswith("no heartbeat for 5.0 s")


def test_a_remote_peer_whose_watched_connection_is_up_is_slow_not_gone_until_the_slow_limit():
    peer = Peer(last_heard_s=0.0, watched=True)
    assert why_lost(peer, 5.0, 0.2, 1.0, slow_limit_s=30.0) == ""  # 5 x the heartbeat limit
    assert why_lost(peer, 30.5, 0.2, 1.0, slow_limit_s=30.0) == (
        "no heartbeat for 30.5 s, though its connection is up (its process is there): "
        "hung, stopped or starved that long"
    )


def test_a_remote_peer_whose_watched_connection_went_down_is_lost_one_interval_later():
    peer = Peer(last_heard_s=0.0, watched=True, disconnected_s=4.0)
    # down for less than an interval: no longer slow, the heartbeat limit holds
    assert why_lost(peer, 4.1, 0.2, 1.0, slow_limit_s=30.0) == (
        "no heartbeat for 4.1 s; its connection closed 0.1 s ago"
    )
    assert why_lost(peer, 4.1, 0.2, 5.0, slow_limit_s=30.0) == ""
    assert why_lost(peer, 4.3, 0.2, 5.0, slow_limit_s=30.0).startswith("its connection closed 0.3 s ago")


def test_the_longest_stall_kept_is_what_heartbeats_report():
    record = stalls((1.0, 1.5), (2.0, 3.2), keep=10.0)
    assert record.longest_s() == pytest.approx(1.2)
    record.tick(20.0, 20.05)  # both older than keep now
    assert record.longest_s() == 0.0
