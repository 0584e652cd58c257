"""The sidecar's background tasks, each with an owner.

A task the sidecar starts and does not await (a room's pump, a verdict, a
fence, a peer's retirement) is started through :meth:`Tasks.spawn`, which
keeps it until it ends. A task that ends with an exception is logged at once
with what it was doing, its room and its peer, so nothing fails silently and
asyncio never prints "Task exception was never retrieved". At shutdown
:meth:`Tasks.close` cancels every task still running and waits for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any

log = logging.getLogger("pd_transfer.agent")


class Tasks:
    """The background tasks of one sidecar: kept while they run, failures logged,
    all cancelled and awaited by :meth:`close`."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, room: int | str = "", peer: str = ""
    ) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``room`` and ``peer`` name it in a failure's log."""
        task = asyncio.create_task(coro)
        self._running.add(task)
        task.add_done_callback(lambda done: self._ended(done, room, peer))
        return task

    def _ended(self, task: asyncio.Task[Any], room: int | str, peer: str) -> None:
        self._running.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            # a coroutine's qualified name (typeshed's get_coro() may also give a generator)
            name = getattr(task.get_coro(), "__qualname__", None) or task.get_name()
            log.error(
                "background task %s failed (room %s, peer %s): %s",
                name,
                room or "-",
                peer or "-",
                error,
                exc_info=error,
                extra={"room": room, "peer": peer} if room or peer else None,
            )

    async def close(self) -> None:
        """Cancel every task still running and wait until all have ended."""
        while self._running:
            running = list(self._running)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def bounded(step: Awaitable[Any], what: str, timeout_s: float = 5.0) -> None:
    """Shutdown never hangs on one step: past ``timeout_s`` it is logged and left behind."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        log.warning("shutdown: %s did not finish within %.0f s; exiting anyway", what, timeout_s)
