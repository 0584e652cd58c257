"""Decode: prefill instances that were lost, until their bootstrap address answers again.

A room names its prefill instance by bootstrap address only. When the
instance this rank had resolved there is lost (its process died, it fell
silent, it closed its sessions), its rooms died with it: their KV was in its
memory. A room claimed afterwards goes to a new resolution of the address,
which, with nothing listening there, would wait ``bootstrap_timeout_s`` for
a rank table. So while an address's last instance is known lost, a claim
waits for the address at most one heartbeat limit (``heartbeat_interval_s *
heartbeat_misses``, what a silent peer is allowed) and then fails with the
loss's reason. A prefill that is back answers in far less: its rank table is
served as soon as its workers registered, before it could have answered a
request. The resolution itself goes on for later rooms; once it succeeds the
address is no longer known lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
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
        self._lost.pop(bootstrap, None)

    async def wait(self, bootstrap: str, resolution: Awaitable[T]) -> T:
        """``resolution``'s result; bounded by the grace while ``bootstrap`` is known lost."""
        lost = self._lost.get(bootstrap)
        if lost is None:
            return await resolution
        try:
            async with asyncio.timeout(self.grace_s):
                return await resolution
        except TimeoutError:
            since_s, text, code = lost
            raise PdTransferError(
                f"prefill instance {bootstrap} was lost {time.monotonic() - since_s:.1f} s ago ({text}) "
                f"and its bootstrap address has not answered for {self.grace_s:.1f} s since: "
                f"its rooms were lost with it",
                code=code,
            ) from None
