"""When to try again after a failure: exponential backoff with jitter, to a cap.

A decode sidecar whose configured prefill instance rejects it (or cannot be
reached) resolves it again later, and a prefill rank whose rank 0 refuses its
announcement announces again later: never in a tight loop. Each failure in a
row doubles the ceiling of the wait (``base_s``, ``2 * base_s``, ... up to
``cap_s``); the wait itself is drawn from the upper half of it, so sidecars
that failed together do not retry together. The wait runs from the start of
the failed try: a try refused at once waits it all, one that timed out after
longer starts again at once. A success starts over.

    failures in a row   1    2    3    4    5    6     7 and on
    ceiling, s          0.5  1    2    4    8    16    30
    (each wait is drawn between half the ceiling and the ceiling)

Plain data and arithmetic on the times it is given: no asyncio, no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

BASE_S = 0.5
CAP_S = 30.0


@dataclass
class Backoff:
    base_s: float = BASE_S
    cap_s: float = CAP_S
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0  # in a row, since the last success
    next_try_s: float = 0.0  # monotonic time of the next try (0: now)
    error: str = ""  # the last failure's text
    same_error: bool = False  # the last failure's text was the one before's (log it at debug)

    def failed(self, started_s: float, error: str = "") -> float:
        """Record the failure of the try that started at ``started_s``; returns the time of
        the next try."""
        self.same_error, self.error = self.failures > 0 and error == self.error, error
        self.failures += 1
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures - 1, 32))
        self.next_try_s = started_s + self.rng.uniform(ceiling / 2, ceiling)
        return self.next_try_s

    def wait_s(self, now_s: float) -> float:
        return max(0.0, self.next_try_s - now_s)

    def succeeded(self) -> None:
        self.failures, self.next_try_s, self.error, self.same_error = 0, 0.0, "", False

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_try_s

    def describe(self, now_s: float) -> str:
        """``next try in 3.2 s (2 failed tries)``: for readiness reasons and logs."""
        tries = f"{self.failures} failed {'try' if self.failures == 1 else 'tries'}"
        return f"next try in {self.wait_s(now_s):.1f} s ({tries})"
