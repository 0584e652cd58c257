"""What both simulated engines share: their options and a room's bookkeeping.

Imports the client's status types and the sim's own modules only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pd_transfer.client import Refused, RoomState
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.layout.views import Pool
from pd_transfer.sim.report import RoomOutcome, WorkerReport
from pd_transfer.sim.schedule import ScheduledRequest

log = logging.getLogger("pd_transfer.sim")


@dataclass(frozen=True)
class EngineOptions:
    """How an engine drives its rooms.

    ``room_timeout_s`` bounds each ``wait`` on a room; a room still not
    terminal then is counted as failed (status ``timeout``) and aborted.
    ``progress_path``, when set, gets one line per finished room
    (``<request index> <room> <status>``), flushed at once, for a supervisor
    that counts lines.
    """

    chunk_pages: int = 64
    room_timeout_s: float = 60.0
    bootstrap_addr: str = ""
    progress_path: str | None = None


def own_indices(
    geometry: RankGeometry, request: ScheduledRequest
) -> dict[Pool, tuple[np.ndarray, np.ndarray]]:
    """The request's ``(src, dst)`` indices for the pools this rank registers.

    A pipeline stage without linear-attention layers has no state pool, so it
    neither sends nor expects a state slot.
    """
    pools = geometry.pools()
    return {pool: pair for pool, pair in request.transfer_indices().items() if pool in pools}


def call_args(geometry: RankGeometry, request: ScheduledRequest, side: int) -> dict[str, Any]:
    """Keyword arguments of send/expect for ``side`` (0 source, 1 destination), last chunk."""
    indices = own_indices(geometry, request)
    empty = np.empty(0, np.int64)
    aux = indices.get(Pool.AUX)
    return {
        "state_slots": indices.get(Pool.MAMBA, (empty, empty))[side],
        "swa_pages": indices.get(Pool.SWA, (empty, empty))[side],
        "aux_row": None if aux is None else int(aux[side][0]),
    }


class ProgressLog:
    """Records outcomes; logs a line every tenth of the rooms (and at the end).

    Also appends one line per room to the progress file, if any.
    """

    def __init__(self, rank: str, report: WorkerReport, progress_path: str | None = None) -> None:
        self.rank = rank
        self.report = report
        self.started = time.monotonic()
        self._step = max(1, report.num_requests // 10)
        self._path = progress_path

    def record(self, outcome: RoomOutcome) -> None:
        self.report.add(outcome)
        if self._path is not None:
            word = "mismatch" if outcome.mismatches else outcome.status
            with open(self._path, "a") as out:
                out.write(f"{outcome.index} {outcome.room} {word}\n")
        if not outcome.ok:
            log.warning(
                "%s room %d (request %d) %s [%s]: %s",
                self.rank,
                outcome.room,
                outcome.index,
                outcome.status,
                outcome.code,
                outcome.reason or "; ".join(outcome.mismatches[:3]),
            )
        else:
            log.debug("%s room %d done in %.3f s", self.rank, outcome.room, outcome.latency_s or 0)
        done = len(self.report.outcomes)
        if done % self._step == 0 or done == self.report.num_requests:
            elapsed = time.monotonic() - self.started
            failed = sum(not o.ok for o in self.report.outcomes)
            log.info(
                "%s: %d/%d rooms done, %d failed, %.1f rooms/s",
                self.rank,
                done,
                self.report.num_requests,
                failed,
                done / elapsed if elapsed > 0 else 0.0,
            )


def state_outcome(
    request: ScheduledRequest, state: RoomState, waited_s: float, latency_s: float | None = None
) -> RoomOutcome:
    """The outcome of a room whose wait returned ``state`` (terminal or not)."""
    if not state.is_terminal:
        return RoomOutcome(
            request.index,
            request.room,
            "timeout",
            "timeout",
            f"still {state.status.value} after waiting {waited_s:g} s",
            latency_s,
        )
    return RoomOutcome(
        request.index, request.room, state.status.value, state.code_text, state.reason, latency_s
    )


def refused_outcome(request: ScheduledRequest, error: Refused) -> RoomOutcome:
    return RoomOutcome(request.index, request.room, "failed", error.code_text, error.reason)
