"""Plain counters of what a sidecar did; the Prometheus exporter reads these."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SidecarStats:
    rooms: Counter = field(default_factory=Counter)       # outcome -> count
    verdicts: Counter = field(default_factory=Counter)    # accepted/rejected -> count
    peers_lost: int = 0
    nbytes: int = 0

    def count_room(self, outcome: str) -> None:
        self.rooms[outcome] += 1

    def count_verdict(self, accepted: bool) -> None:
        self.verdicts["accepted" if accepted else "rejected"] += 1
