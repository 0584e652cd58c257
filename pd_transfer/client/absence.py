"""A sidecar that is gone: its connection closed, and its path refuses every connection since.

A worker's call to a sidecar that is not up yet waits for it, connecting
again every 20 ms until the call's deadline: a worker may start first. A
sidecar that was there and died looks the same from the path (no socket
file, or one nobody accepts on), and each call of a worker would then wait
its whole timeout: an engine that polls its rooms every step would stall
``timeout_s`` per room. So once a connection this worker had was lost, a
path that still refuses connections :data:`GONE_AFTER_S` later is taken for
a sidecar that is gone, and calls fail at once with ``ConnectionError``
(``SidecarLost`` to the caller) until a connection gets through again. A
sidecar restarted within that time is simply connected to.
"""

from __future__ import annotations

import time

#: how long after its connection was lost a path that refuses connections means the sidecar is gone
GONE_AFTER_S = 2.0


class Absence:
    """When this link last lost its sidecar's connection, until a connection gets through."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lost_s: float | None = None

    def lost(self) -> None:
        """The sidecar closed the connection, or it broke (kept: the first loss counts)."""
        if self._lost_s is None:
            self._lost_s = time.monotonic()

    def back(self) -> None:
        self._lost_s = None

    def check_refused(self) -> None:
        """After a refused connection: raise once it is :data:`GONE_AFTER_S` since the loss."""
        if self._lost_s is not None and (since_s := time.monotonic() - self._lost_s) >= GONE_AFTER_S:
            raise ConnectionError(
                f"the sidecar at {self.path} is gone: its connection closed {since_s:.1f} s ago "
                f"and the path refuses connections since"
            )
