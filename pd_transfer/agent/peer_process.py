"""A peer's process on this host, seen directly: running, stopped, or gone.

Silence alone cannot tell a peer that is gone from one that is slow: a
sidecar starved of CPU next to a busy engine sends its heartbeats late, like
a dead one sends none. A peer on the same host (its Register's ``host_id``
equals ours) also names its process (``pid`` and the process's start time,
``/proc/<pid>/stat`` field 22, in clock ticks since boot), and this sidecar
reads ``/proc/<pid>/stat`` on each timer tick:

- no such process, another process under that pid (its start time differs),
  or a zombie: the peer is gone, whatever its heartbeats said;
- stopped (SIGSTOP, a debugger): it cannot answer, and its silence counts;
- running or sleeping: it is alive, and silence means slow, not gone.

A named process that this sidecar cannot see at registration (another pid
namespace on the same host) is not probed: its heartbeats alone decide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TypedDict


class ProcessState(Enum):
    RUNNING = "running"
    STOPPED = "stopped"
    GONE = "gone"


@dataclass(frozen=True)
class ProcessIdentity:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_ticks: int

    def state(self) -> ProcessState:
        """What ``/proc`` says of this process now."""
        fields = _stat_fields(self.pid)
        if fields is None or fields[1] != self.start_ticks or fields[0] in "ZXx":
            return ProcessState.GONE
        return ProcessState.STOPPED if fields[0] in "Tt" else ProcessState.RUNNING


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """(state, start time in ticks) of process ``pid``; None where there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text.rsplit(")", 1)[-1].split()  # after "pid (comm)": the comm may hold spaces
    try:
        return rest[0], int(rest[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def own_identity() -> ProcessIdentity | None:
    """This process, as its peers on this host can find it (None without /proc)."""
    fields = _stat_fields(os.getpid())
    return ProcessIdentity(os.getpid(), fields[1]) if fields is not None else None


class ProcessFields(TypedDict, total=False):
    """A Register's fields that name the sending process."""

    pid: int
    process_start_ticks: int


def own_register_fields() -> ProcessFields:
    """This process's ``pid`` and ``process_start_ticks`` for a Register (none without /proc)."""
    me = own_identity()
    return {"pid": me.pid, "process_start_ticks": me.start_ticks} if me is not None else {}


def peer_identity(pid: int, start_ticks: int, peer_host_id: str, host_id: str) -> ProcessIdentity | None:
    """The process a peer named in its Register, if it is on this host and visible here
    (else None: nothing to probe). A peer that named none sends ``pid`` 0."""
    if pid <= 0 or peer_host_id != host_id:
        return None
    identity = ProcessIdentity(pid, start_ticks)
    return identity if identity.state() is not ProcessState.GONE else None
