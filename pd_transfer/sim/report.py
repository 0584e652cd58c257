"""What a simulated worker did, room by room, and the JSON report the demo reads.

Report fields (top level): ``role``, ``worker_id``, ``rank``, ``model``,
``ok`` (exit status 0), ``rooms`` (count), ``succeeded``, ``failed`` (list of
``{room, index, status, code, reason}``), ``bytes`` (prefill: logical bytes
filled; decode: bytes verified), ``bytes_verified``, ``mismatches`` (at most
``MAX_MISMATCH_LINES`` lines), ``num_mismatches``, ``latencies_s`` (decode:
expect -> success per room, in schedule order), ``latency_p50_s``,
``latency_p99_s``, ``elapsed_s``, ``error`` (a fatal error: registration
refused, terminated, ...; null when none).

Pure data and JSON; no I/O beyond :func:`write_report`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAX_MISMATCH_LINES = 50


@dataclass(frozen=True)
class RoomOutcome:
    """How one room ended on this worker."""

    index: int
    room: int
    status: str  # a RoomStatus value, or "timeout" when it never ended
    code: str | None = None
    reason: str = ""
    latency_s: float | None = None
    nbytes: int = 0
    mismatches: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "success" and not self.mismatches


@dataclass
class WorkerReport:
    role: str
    worker_id: str
    rank: str
    model: str
    num_requests: int
    outcomes: list[RoomOutcome] = field(default_factory=list)
    nbytes_filled: int = 0
    elapsed_s: float = 0.0
    error: str | None = None

    def add(self, outcome: RoomOutcome) -> None:
        self.outcomes.append(outcome)

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and len(self.outcomes) == self.num_requests
            and all(o.ok for o in self.outcomes)
        )

    @property
    def nbytes_verified(self) -> int:
        return sum(o.nbytes for o in self.outcomes if o.ok)

    def to_dict(self) -> dict[str, Any]:
        outcomes = sorted(self.outcomes, key=lambda o: o.index)
        latencies = [o.latency_s for o in outcomes if o.ok and o.latency_s is not None]
        mismatches = [line for o in outcomes for line in o.mismatches]
        return {
            "role": self.role,
            "worker_id": self.worker_id,
            "rank": self.rank,
            "model": self.model,
            "ok": self.ok,
            "rooms": len(outcomes),
            "requests": self.num_requests,
            "succeeded": sum(o.status == "success" for o in outcomes),
            "failed": [
                {"room": o.room, "index": o.index, "status": o.status, "code": o.code, "reason": o.reason}
                for o in outcomes
                if o.status != "success"
            ],
            "bytes": self.nbytes_filled if self.role == "prefill" else self.nbytes_verified,
            "bytes_verified": self.nbytes_verified,
            "num_mismatches": len(mismatches),
            "mismatches": mismatches[:MAX_MISMATCH_LINES],
            "latencies_s": latencies,
            "latency_p50_s": _percentile(latencies, 50),
            "latency_p99_s": _percentile(latencies, 99),
            "elapsed_s": self.elapsed_s,
            "error": self.error,
        }


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def write_report(path: str | os.PathLike, report: WorkerReport) -> None:
    """Write the report atomically (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(report.to_dict(), out, indent=2)
            out.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
