"""When a peer counts as lost, and why a stall of our own never makes it so.

A peer is *gone*, and lost at once, when its connection closed and stayed
closed for longer than one interval, or, on this host, when its process ended
(:mod:`~pd_transfer.agent.peer_process`), whatever its heartbeats said. Its
connection is watched by ZeroMQ and the kernel, not by the Python loop
(:mod:`~pd_transfer.agent.channels`): a process that dies closes it at once,
and the kernel's keepalive (:mod:`~pd_transfer.agent.zmq_bounds`) closes it
within ``peer_connection_timeout_s`` when the peer's host vanished.
Otherwise only the silence of the peer's own heartbeats speaks, and silence
means slow while there is evidence that the peer is there:

- silence is measured in time this process could listen: while our own
  event loop was stalled (starved of CPU, or blocked by a long call), the
  peer's heartbeats wait unread in the socket, and that stretch is not
  counted against it;
- a peer on this host whose process is seen running is slow, not gone: it is
  lost only once silent for ``slow_peer_limit_s``; one seen stopped (SIGSTOP)
  is lost after the heartbeat limit;
- a peer not on this host (or whose process this sidecar cannot see) whose
  watched connection is up is slow, not gone, alike: lost only once silent
  for ``slow_peer_limit_s``. Its process holds the connection open (it would
  close were the process to end, or after the keepalive's timeout were its
  host gone), so it is there, starved, hung or stopped;
- any other peer (its connection unwatched, or down for less than one
  interval) is lost after the heartbeat limit, plus the longest stall of its
  own loop that its last heartbeat reported (at most up to
  ``slow_peer_limit_s``): it was starved before, and may be again.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

from pd_transfer.agent.peer_process import ProcessIdentity, ProcessState

log = logging.getLogger(__name__)


class Heard(Protocol):
    last_heard_s: float
    disconnected_s: float | None
    watched: bool  # the kernel's keepalive watches its connection: up, its process is there
    peer_process: ProcessIdentity | None  # on this host and visible here, else None
    peer_stall_s: float  # the longest stall its last heartbeat reported


class LoopStalls:
    """The stretches in which this loop ran later than it asked to, over the recent past.

    The timer task calls :meth:`tick` after each sleep of ``tick_s``; anything
    beyond the expected wake-up by more than ``tick_s`` is a stall. Lateness
    below that is ordinary scheduling noise and is not recorded, so a loop
    that is merely busy does not slow the detection of a dead peer.
    """

    def __init__(self, tick_s: float, keep_s: float, warn_s: float) -> None:
        self.tick_s, self.keep_s, self.warn_s = tick_s, keep_s, warn_s
        self._stalls: deque[tuple[float, float]] = deque()  # (start, end), oldest first
        self.total_s = 0.0

    def tick(self, slept_from: float, now: float) -> float:
        """Record the stall in ``[slept_from + tick_s, now]`` if long enough; its length."""
        expected = slept_from + self.tick_s
        late = now - expected
        while self._stalls and self._stalls[0][1] < now - self.keep_s:
            self._stalls.popleft()
        if late <= self.tick_s:
            return 0.0
        self._stalls.append((expected, now))
        self.total_s += late
        if late >= self.warn_s:
            log.warning(
                "this sidecar's event loop stalled for %.2f s (starved of CPU or blocked); "
                "peers' silence during the stall is not counted against them",
                late,
            )
        return late

    def within(self, start: float, end: float) -> float:
        """Seconds of recorded stalls inside ``[start, end]``."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._stalls)

    def longest_s(self) -> float:
        """The longest stall kept (the last ``keep_s``): what heartbeats report to peers."""
        return max((b - a for a, b in self._stalls), default=0.0)


def why_lost(
    peer: Heard,
    now: float,
    interval_s: float,
    limit_s: float,
    stalls: LoopStalls | None = None,
    slow_limit_s: float = 0.0,
) -> str:
    """Why ``peer`` counts as lost now ("" while it does not)."""

    def unseen(since: float) -> float:  # seconds since ``since`` that this loop was awake
        return now - since - (stalls.within(since, now) if stalls is not None else 0.0)

    process = peer.peer_process
    state = process.state() if process is not None else None
    if process is not None and state is ProcessState.GONE:
        return f"its process (pid {process.pid} on this host) ended"
    if peer.disconnected_s is not None and unseen(peer.disconnected_s) > interval_s:
        return (
            f"its connection closed {now - peer.disconnected_s:.1f} s ago and did not "
            f"come back (the peer process ended or stopped, or its host is unreachable)"
        )
    quiet = now - peer.last_heard_s
    blind = quiet - unseen(peer.last_heard_s)
    allowed_s, why = _allowed(peer, state, limit_s, max(slow_limit_s, limit_s))
    if quiet - blind > allowed_s:
        stalled = f", {blind:.1f} s of it while this sidecar was stalled" if blind >= 0.05 else ""
        if peer.disconnected_s is not None:  # down for less than an interval so far
            why += f"; its connection closed {now - peer.disconnected_s:.1f} s ago"
        return f"no heartbeat for {quiet:.1f} s{stalled}{why}"
    return ""


def _allowed(peer: Heard, state: ProcessState | None, limit_s: float, slow_s: float) -> tuple[float, str]:
    """How long ``peer`` may stay silent, and what its loss reason adds about that."""
    process = peer.peer_process  # a state is its process's
    if process is not None and state is ProcessState.RUNNING:
        pid = process.pid
        return slow_s, f", though its process (pid {pid} on this host) runs: hung or starved that long"
    if process is not None and state is ProcessState.STOPPED:
        return limit_s, f", its process (pid {process.pid} on this host) is stopped"
    if peer.watched and peer.disconnected_s is None:
        return (
            slow_s,
            ", though its connection is up (its process is there): hung, stopped or starved that long",
        )
    credit_s = min(max(peer.peer_stall_s, 0.0), slow_s - limit_s)
    if credit_s >= 0.05:
        return limit_s + credit_s, f" ({credit_s:.1f} s more allowed for the stalls it reported)"
    return limit_s, ""
