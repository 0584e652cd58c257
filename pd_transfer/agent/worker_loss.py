"""The worker's registration lives as long as the connection it came on.

A worker registers its pools through one client connection (``unix://`` or
``ipc://``, see :mod:`pd_transfer.agent.worker_endpoint`). When that
connection closes (the worker process ended, SIGKILL included, or it closed
the client it registered with), the worker is gone, and the sidecar lets go
of everything it held for it:

1. its live rooms fail with ``worker_lost`` and the reason (prefill writes in
   flight finish first; decode fences its sources as for an abort): each side
   does this and step 2 in its ``on_worker_lost`` (:class:`~pd_transfer.agent.side.Side`);
2. decode closes its sessions to the prefill ranks (which unmap its
   segments). Prefill keeps its decode sessions, since rooms of the other
   prefill ranks may still be running on them (a TP 2 instance whose rank 0
   finished and exited first), answers their new rooms with ``worker_lost``,
   and closes them when the worker registers again, so that each decode rank
   resolves the instance anew and gets a verdict on the new registration.
   Prefill rank 0 answers requests for the rank table with ``worker_lost``
   (after authenticating them as ever) until its worker is back;
3. the worker's regions are unmapped (the tcp receiver into them stops);
4. ``/readyz`` answers 503 with the reason, and the next registration (the
   restarted worker) is taken like the first one.

A worker that uses several clients keeps the one it registered with open
for as long as it works.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Hashable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pd_transfer.agent.rooms import Room, RoomView
    from pd_transfer.agent.worker_endpoint import WorkerEndpoint
    from pd_transfer.layout.geometry import RankGeometry

log = logging.getLogger(__name__)


class WorkerHost(Protocol):
    """What the binding asks of its sidecar."""

    @property
    def geometry(self) -> RankGeometry | None: ...

    @property
    def rooms(self) -> RoomView[Room]: ...

    @property
    def stopping(self) -> bool: ...

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, room: int | str = "", peer: str = ""
    ) -> asyncio.Task[Any]: ...

    async def unregister(self, why: str) -> None:
        """Fail the worker's rooms (its side's ``on_worker_lost``) and release its pools."""


class WorkerBinding:
    """Which connection the registered worker holds, and why the last one was let go."""

    def __init__(self, host: WorkerHost, worker_endpoint: str) -> None:
        self.host = host
        self.worker_endpoint = worker_endpoint
        self.lock = asyncio.Lock()  # a registration and a release never interleave
        self.worker_id = ""
        self.connection: Hashable | None = None
        self.lost_reason = ""  # for /readyz until the worker registers again
        self.releases = 0

    def bind(self, worker_id: str, connection: Hashable | None, endpoint: WorkerEndpoint | None) -> None:
        """The registration of ``worker_id`` through ``connection`` is committed; a
        connection that closed meanwhile releases it at once."""
        self.worker_id, self.connection, self.lost_reason = worker_id, connection, ""
        if connection is None:
            log.warning(
                "the worker's connection cannot be watched (this libzmq has no SRCFD): "
                "a worker that exits keeps its registration until the sidecar restarts"
            )
        elif endpoint is not None and not endpoint.is_open(connection):
            self.on_closed(connection)

    def on_closed(self, connection: Hashable) -> None:
        """The worker endpoint saw ``connection`` close."""
        host = self.host
        if connection != self.connection or host.geometry is None or host.stopping:
            return
        self.connection = None
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        why = (
            f"worker {self.worker_id} is gone: its connection to {self.worker_endpoint} closed at {stamp} UTC"
        )
        host.spawn(self.release(why))

    async def release(self, why: str) -> None:
        host = self.host
        async with self.lock:
            if host.geometry is None:
                return
            live = len(host.rooms.live())
            # a worker that finished its rooms and exited is routine; one that left rooms is not
            log.log(
                logging.WARNING if live else logging.INFO,
                "%s; failing its %d live room(s) and releasing its pools",
                why,
                live,
            )
            self.lost_reason = f"{why}; waiting for it to register again"
            self.releases += 1
            await host.unregister(why)
            log.info("the pools of worker %s are released; a new registration is welcome", self.worker_id)
