"""Decode: prefill instances that were lost, until their bootstrap address answers again.

A room names its prefill instance by bootstrap address only. When the
instance this rank had resolved there is lost (its process died, it fell
silent, it closed its sessions), its rooms died with it: their KV was in its
memory. A room claimed afterwards goes to a new resolution of the address,
which, with nothing listening there, would wait ``bootstrap_timeout_s`` for
a rank table. So while an address's last instance is known lost, a claim
waits at most one heartbeat limit (``heartbeat_interval_s *
heartbeat_misses``, what a silent peer is allowed) for the address to answer
with a rank table, and then fails with the loss's reason. A prefill that is
back answers in far less: its rank table is served as soon as its workers
registered, before it could have answered a request. Once the table arrived
the address is no longer known lost, and the claim waits for the rest of
the resolution (sessions, verdicts) as any other. The resolution goes on
for later rooms either way.
"""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

from pd_transfer.errors import PdTransferError, Reason

T = TypeVar("T")


class LostAddresses:
    """Per bootstrap address: when and why its last resolved instance was lost."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._lost: dict[str, tuple[float, str, Reason]] = {}

    def lost(self, bootstrap: str, text: str, code: Reason) -> None:
        self._lost[bootstrap] = (time.monotonic(), text, code)

    def back(self, bootstrap: str) -> None:
        """The address answered (its rank table arrived)."""
        self._lost.pop(bootstrap, None)

    async def wait(self, bootstrap: str, resolution: asyncio.Task[T]) -> T:
        """``resolution``'s result (never cancelled here); the PdTransferError of the loss when
        ``bootstrap`` is known lost and has not answered within the grace."""
        if bootstrap in self._lost:
            await asyncio.wait({resolution}, timeout=self.grace_s)
            lost = self._lost.get(bootstrap)
            if lost is not None and not resolution.done():
                since_s, text, code = lost
                raise PdTransferError(
                    f"prefill instance {bootstrap} was lost {time.monotonic() - since_s:.1f} s ago "
                    f"({text}) and its bootstrap address has not answered for {self.grace_s:.1f} s "
                    f"since: its rooms were lost with it",
                    code=code,
                )
        return await asyncio.shield(resolution)
