"""The worker's registration lives as long as the connection it came on.

A worker registers its pools through one client connection (``unix://`` or
``ipc://``, see :mod:`pd_transfer.agent.worker_endpoint`). When that
connection closes (the worker process ended, SIGKILL included, or it closed
the client it registered with), the worker is gone, and the sidecar lets go
of everything it held for it:

1. its live rooms fail with ``worker_lost`` and the reason (prefill writes in
   flight finish first; decode fences its sources as for an abort);
2. decode closes its sessions to the prefill ranks (which unmap its
   segments). Prefill keeps its decode sessions, since rooms of the other
   prefill ranks may still be running on them (a TP 2 instance whose rank 0
   finished and exited first), answers their new rooms with ``worker_lost``,
   and closes them when the worker registers again, so that each decode rank
   resolves the instance anew and gets a verdict on the new registration.
   Prefill rank 0 stops serving the rank table until its worker is back;
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
from collections.abc import Hashable

from pd_transfer.agent.decode import retire
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Close

log = logging.getLogger(__name__)


class WorkerBinding:
    """Which connection the registered worker holds, and why the last one was let go."""

    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.lock = asyncio.Lock()  # a registration and a release never interleave
        self.worker_id = ""
        self.connection: Hashable | None = None
        self.lost_reason = ""  # for /readyz until the worker registers again
        self.releases = 0
        self.stale_peers: set[int] = set()  # prefill: decode sessions verdicted before the loss

    def bind(self, worker_id: str, connection: Hashable | None, endpoint) -> None:
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
        sidecar = self.sidecar
        if connection != self.connection or sidecar.geometry is None or sidecar.stopping:
            return
        self.connection = None
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        why = (
            f"worker {self.worker_id} is gone: its connection to {sidecar.config.worker_endpoint} "
            f"closed at {stamp} UTC"
        )
        sidecar.spawn(self.release(why))

    async def release(self, why: str) -> None:
        sidecar = self.sidecar
        async with self.lock:
            if sidecar.geometry is None:
                return
            live = len(sidecar.rooms.live())
            # a worker that finished its rooms and exited is routine; one that left rooms is not
            log.log(
                logging.WARNING if live else logging.INFO,
                "%s; failing its %d live room(s) and releasing its pools",
                why,
                live,
            )
            self.lost_reason = f"{why}; waiting for it to register again"
            self.releases += 1
            sidecar.registered.clear()
            if sidecar.config.role is Role.PREFILL:
                await _release_prefill(sidecar, why)
            else:
                await _release_decode(sidecar, why)
            await sidecar.dataplane.unmap_local()
            sidecar.geometry, sidecar.handles, sidecar.pp_size = None, {}, 1
            log.info("the pools of worker %s are released; a new registration is welcome", self.worker_id)


async def _release_prefill(sidecar, why: str) -> None:
    side = sidecar.side
    text = f"the prefill worker is gone ({why})"
    # fail_room waits for each target's write in flight: no copy reads the regions after
    await asyncio.gather(
        *(
            side.fail_room(room, Reason.WORKER_LOST, f"room {room.room}: {text}")
            for room in sidecar.rooms.live()
        ),
        return_exceptions=True,
    )
    for task in sidecar.worker_tasks:
        task.cancel()
    sidecar.worker_tasks.clear()
    if sidecar.bootstrap_server is not None:  # rank 0: no table until its worker is back
        sidecar.bootstrap_server.close()
        sidecar.bootstrap_server = None
    side.table = None
    side.table_ready.clear()
    sidecar.worker.stale_peers = {key for key, peer in side.peers.items() if peer.accepted}


async def close_stale_sessions(sidecar) -> None:
    """Prefill, once a new registration is committed: the decode sessions verdicted on the
    lost worker's registration get a Close, and resolve this instance anew."""
    side, stale = sidecar.side, sidecar.worker.stale_peers
    sidecar.worker.stale_peers = set()
    text = "the prefill worker registered again: resolve this instance anew for a new verdict"
    for key in stale:
        peer = side.peers.get(key)
        if peer is None:
            continue
        try:
            async with asyncio.timeout(retire.CLOSE_SEND_TIMEOUT_S):
                await peer.channel.send(Close(reason=Reason.WORKER_LOST, reason_text=text))
        except Exception as err:  # a peer already gone: released all the same
            log.debug("prefill: no Close to %s: %s", peer.rank_id, err)
        sidecar.observe.peer(peer.rank_id, "lost", f"session closed: {text}", peer.channel)
        side.release_peer(peer.channel, Reason.WORKER_LOST, f"decode peer {{}}: {text}")


async def _release_decode(sidecar, why: str) -> None:
    side = sidecar.side
    text = f"the decode worker is gone ({why})"
    for room in sidecar.rooms.live():
        side._fail(room, Reason.WORKER_LOST, f"room {room.room}: {text}")
    prefill = side.prefill
    instances = list(prefill.retired)
    for task in prefill.instances.values():
        if not task.done():
            task.cancel()  # a resolution closes the sessions it opened
        elif not task.cancelled() and task.exception() is None:
            instances.append(task.result())
    prefill.instances.clear()
    prefill.retired.clear()
    prefill.backoffs.clear()  # the next worker resolves its instances afresh
    for instance in instances:
        for peer in instance.peers.values():
            if not peer.channel.closed:
                sidecar.observe.peer(peer.rank_id, "lost", f"session closed: {text}", peer.channel)
    await asyncio.gather(*(retire.close_sessions(instance) for instance in instances), return_exceptions=True)
