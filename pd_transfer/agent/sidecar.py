"""The sidecar: one per GPU worker, prefill or decode.

Owns the event loop's tasks (one task group), the sockets (worker endpoint,
control ROUTER), the room table, the worker's registration and mapped regions,
and the data plane; the role's logic lives in :mod:`.prefill` and
:mod:`.decode` (:mod:`.roles` gives a sidecar its side: it is generic over that
side's room type). A side is handed a :class:`~.side_context.SideContext`, never
the sidecar; what only one role serves (prefill rank 0's rank table) is that
side's, from bind to close. Timers (room deadlines, heartbeats, lost peers) run
here.

Shutdown: the first stop request drains (new rooms are refused, live rooms
get ``drain_s`` to finish, then fail with ``shutting_down``); a second one
stops at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic

from pd_transfer.agent import integrity, zmq_bounds
from pd_transfer.agent.admission import Admission
from pd_transfer.agent.auth import SecureContext, Security
from pd_transfer.agent.channels import Channel, IncomingChannels
from pd_transfer.agent.dataplane import DataPlane
from pd_transfer.agent.http import HttpServer
from pd_transfer.agent.liveness import LoopStalls
from pd_transfer.agent.observe import Observer
from pd_transfer.agent.peer_watch import PeerWatch
from pd_transfer.agent.rooms import Room, RoomT, RoomTable, pool_requests
from pd_transfer.agent.side import PeerServer, Side
from pd_transfer.agent.side_context import Registration, SideContext
from pd_transfer.agent.startup import ReadyFile, binding, prepare_worker_endpoint
from pd_transfer.agent.tasks import Tasks, bounded
from pd_transfer.agent.worker_endpoint import WorkerEndpoint
from pd_transfer.agent.worker_loss import WorkerBinding
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry, Role, check_geometry
from pd_transfer.protocol import (
    ROOM_FEATURES,
    Capabilities,
    Message,
    geometry_from_data,
)
from pd_transfer.protocol.worker_requests import (
    AbandonRequest,
    AbortRequest,
    LayerReadyRequest,
    PollRequest,
    RegisterRequest,
    SendRequest,
    WaitRequest,
    WorkerRequest,
)

log = logging.getLogger(__name__)


class Sidecar(Generic[RoomT]):
    def __init__(
        self,
        config: SidecarConfig,
        make_side: Callable[[SideContext[RoomT]], tuple[Side[RoomT], PeerServer | None]],
        drain_s: float = 5.0,
        security: Security | None = None,
    ) -> None:
        self.config = config
        self.drain_s = drain_s
        # every socket made from this context finds the secret and keys (agent/auth.py)
        self.security = security or Security.from_config(config)
        self.context = zmq_bounds.watching_peers(SecureContext(self.security), config)
        self.rooms: RoomTable[RoomT] = RoomTable(config.room_ttl_s, config.max_rooms)
        self.admission = Admission(config)  # rooms per peer, bytes in flight (agent/admission.py)
        self.observe: Observer = Observer(self)
        self.observe.watch_admission(self.admission)
        self.security.on_failure = self.observe.auth_failure
        self.security.lobby.on_refused = self.observe.connection_refused
        self.registration: Registration | None = None  # the registered worker
        # the registration's connection (agent/worker_loss.py)
        self.worker = WorkerBinding(self, config.worker_endpoint)
        self.endpoint: WorkerEndpoint | None = None
        self.dataplane = DataPlane(
            config,
            self.context,
            on_bad_frame=self.observe.bad_frame,
            on_connection_closed=self.observe.connection_closed,
        )
        self.tasks = Tasks()  # every background task, owned (agent/tasks.py)
        self._generations = itertools.count(1)
        self.control: IncomingChannels | None = None
        self.side, self.peer_server = make_side(self._side_context())
        self.registered = asyncio.Event()
        self._stop = asyncio.Event()
        self._force = False
        self._stopping = False
        self.http: HttpServer | None = None
        interval = config.heartbeat_interval_s  # the timers tick at min(interval, 0.1 s)
        self.stalls = LoopStalls(
            tick_s=min(interval, 0.1),
            warn_s=max(interval, 0.5),
            keep_s=2 * interval * config.heartbeat_misses + 1.0,
        )
        self.peer_watch = PeerWatch(config, self.stalls, self.observe)  # heartbeats, lost peers
        self.ready_file = ReadyFile(config.ready_file)

    def _side_context(self) -> SideContext[RoomT]:
        """What this sidecar's side uses of it (agent/side_context.py)."""
        return SideContext(
            config=self.config,
            context=self.context,
            security=self.security,
            rooms=self.rooms,
            observe=self.observe,
            admission=self.admission,
            dataplane=self.dataplane,
            spawn=self.spawn,
            next_generation=lambda: next(self._generations),
            capabilities=self.capabilities,
            watch=self.watch,
            registration=lambda: self.registration,
            wait_registered=self.wait_registered,
            worker_lost_reason=lambda: self.worker.lost_reason,
            control_address=lambda: self.control.address if self.control else "",
        )

    @property
    def geometry(self) -> RankGeometry | None:
        """The registered worker's geometry, or None while no worker is registered."""
        return self.registration.geometry if self.registration is not None else None

    # -- lifecycle ---------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, *, force: bool) -> None:
        self._force = self._force or force
        self._stop.set()

    async def run(self) -> None:
        try:  # a failed start (an address in use) still removes what was made: doorbells
            if self.context.zap is not None:  # identity keys checked (agent/zap.py)
                self.spawn(self.context.zap.serve())
            self._serve_worker()
            if self.peer_server is not None:
                self._serve_control(self.peer_server)
            await self._serve_http()
            self.spawn(self._timers())
            self._write_ready_file()
            self.security.log_mode(self.dataplane.engine_listeners)
            if not self.dataplane.copies.startswith("native"):
                log.warning(
                    "shm copies run through numpy, about half as fast as the native loop: %s",
                    self.dataplane.copies,
                )
            log.info(
                "%s sidecar %s serving: worker %s, control %s",
                self.config.role.value,
                self.config.agent_id,
                self.config.worker_endpoint,
                self.control.address if self.control else "-",
            )
            await self._stop.wait()
            if not self._force:
                await self._drain()
        finally:
            await self._close()

    def _serve_worker(self) -> None:
        config = self.config
        prepare_worker_endpoint(config.worker_endpoint)
        self.endpoint = WorkerEndpoint(
            self.context,
            config.worker_endpoint,
            self.handle_worker,
            on_bad_request=self.observe.bad_frame,
            max_requests=config.max_worker_requests,
            on_over_limit=lambda: self.observe.limit_refused("max_worker_requests"),
            on_closed=self.worker.on_closed,
            on_connection_closed=self.observe.connection_closed,
        )
        self.spawn(self.endpoint.serve())

    def _serve_control(self, server: PeerServer) -> None:
        """The ROUTER peers open their sessions on (prefill: decode ranks)."""
        config = self.config
        with binding("control_host", config.control_host, "control_port", config.control_port):
            self.control = IncomingChannels(
                self.context,
                config.control_host,
                config.control_port,
                Role.PREFILL,
                on_bad_frame=self.observe.bad_frame,
                on_refused=server.on_peer_refused,
                on_closed=self.observe.connection_closed,
            )

        async def on_message(channel: Channel, message: Message) -> None:
            self.peer_watch.watch_once(channel, lambda why: server.on_peer_lost(channel, why))
            await server.on_peer_message(channel, message)

        self.spawn(self.control.serve(on_message))

    async def _serve_http(self) -> None:
        config = self.config
        self.http = HttpServer(
            config.http_host,
            config.http_port,
            metrics=self.observe.render,
            ready=self.observe.ready,
            status=self.observe.status,
        )
        with binding("http_host", config.http_host, "http_port", config.http_port):
            await self.http.start()

    async def _close(self) -> None:
        """Stop every task, then close what :meth:`run` opened, each step bounded."""
        await bounded(self.tasks.close(), "stopping tasks")
        if self.endpoint is not None:
            self.endpoint.close()
        if self.http:
            await bounded(self.http.close(), "closing the http server")
        if self.control:
            self.control.close()
        await bounded(self.dataplane.close(), "closing the data plane")
        self.side.close()
        self.context.destroy(linger=0)
        self.ready_file.remove()
        log.info("sidecar %s stopped", self.config.agent_id)

    async def _drain(self) -> None:
        self._stopping = True
        deadline = time.monotonic() + self.drain_s
        while self.rooms.live() and time.monotonic() < deadline and not self._force:
            await asyncio.sleep(0.02)
        for room in self.rooms.live():
            ending = self.side.fail_room(
                room, Reason.SHUTTING_DOWN, f"room {room.room}: the sidecar shut down before it finished"
            )
            if ending is not None:
                await ending
        await asyncio.sleep(0.05)  # let the failure notices leave

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, room: int | str = "", peer: str = ""
    ) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, owned by this sidecar (see :class:`Tasks`)."""
        return self.tasks.spawn(coro, room=room, peer=peer)

    def _write_ready_file(self, *, again: bool = False) -> None:
        """The bound addresses, each one a process on this host can dial (a wildcard
        bind is written as loopback). ``again``: the data receiver started or stopped
        with a worker's registration; the file changes only once serving wrote it."""
        if again and (not self.ready_file.written or self.stopping):
            return
        self.ready_file.write(
            {
                "agent_id": self.config.agent_id,
                "worker_endpoint": self.config.worker_endpoint,
                "control_address": self.control.address if self.control else "",
                "data_address": self.dataplane.receive_address(),
                "http_address": self.http.dial_address if self.http else "",
            }
        )

    # -- worker API ----------------------------------------------------------------
    async def handle_worker(
        self, request: WorkerRequest, connection: Hashable | None = None
    ) -> dict[str, Any]:
        """One worker request, read at the edge into its record (protocol/worker_requests.py)."""
        if isinstance(request, RegisterRequest):
            async with self.worker.lock:
                return await self._register(request, connection)
        if self.geometry is None:
            raise PdTransferError("the worker has not registered its pools yet", code=Reason.NOT_REGISTERED)
        if isinstance(request, (PollRequest, WaitRequest)):
            room = self._room(request.room)
            self.side.check_bell(room)
            if isinstance(request, WaitRequest):
                await room.wait(request.timeout_s)
            return room.reply()
        if isinstance(request, AbortRequest):
            return await self.side.on_worker_abort(request.room)
        if self._stopping:
            raise PdTransferError("the sidecar is shutting down", code=Reason.SHUTTING_DOWN)
        if isinstance(request, LayerReadyRequest):
            return await self.side.on_layer_ready(request)
        if isinstance(request, AbandonRequest):
            return self.side.on_abandon(request)
        refusal = self.rooms.refusal(request.room)
        if refusal:  # the hard bound of the room table: refused at once, never queued
            self.observe.limit_refused("max_rooms")
            raise PdTransferError(
                refusal, code=Reason.TOO_MANY_ROOMS, hint="finish or abort rooms, or raise max_rooms"
            )
        if isinstance(request, SendRequest):
            return await self.side.on_send(request, pool_requests(request))
        return await self.side.on_expect(request, pool_requests(request))

    def _room(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        return room

    async def _register(self, request: RegisterRequest, connection: Hashable | None) -> dict[str, Any]:
        if self.registration is not None:
            raise PdTransferError(
                f"worker {self.worker.worker_id} is registered, and the connection it registered "
                f"through is open",
                code=Reason.ALREADY_REGISTERED,
                hint="a worker registers once per sidecar; a restarted worker registers again "
                "once the old one's connection closed (it exited, or closed that client)",
            )
        geometry = geometry_from_data(request.geometry)
        if geometry.role is not self.config.role:
            raise PdTransferError(
                f"a {geometry.role.value} worker registered with a {self.config.role.value} sidecar",
                code=Reason.ROLE_MISMATCH,
            )
        handles = {str(k): str(v) for k, v in request.handles.items()}
        # the whole registration, handles included: a missing or shared segment is refused
        # here, with the field at fault, before a single segment is mapped
        check_geometry(geometry, handles)
        self.side.before_registering(geometry)  # binds what must be bound before anything is committed
        try:
            await self.dataplane.map_local(geometry, handles)
        except BaseException:
            self.side.registration_failed()
            raise
        self._write_ready_file(again=True)  # decode's data receiver listens from here on
        self.registration = Registration(request.worker_id, geometry, handles, request.pp_size)
        self.registered.set()
        self.worker.bind(request.worker_id, connection, self.endpoint)
        log.info(
            "worker %s registered %s: %d views in %d regions",
            request.worker_id,
            geometry.rank_id,
            len(geometry.views),
            len(geometry.regions),
        )
        await self.side.on_registered()
        return {"rank_id": geometry.rank_id}

    async def wait_registered(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self.registered.wait()
        except TimeoutError:
            raise PdTransferError("the worker did not register in time", code=Reason.NOT_REGISTERED) from None

    async def unregister(self, why: str) -> None:
        """The worker is gone (``why``): its side lets go of what served it, then its pools
        are released and the next registration is taken like the first."""
        self.registered.clear()
        await self.side.on_worker_lost(why)
        await self.dataplane.unmap_local()
        self.registration = None
        self._write_ready_file(again=True)

    # -- peers and timers ----------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(
            transports=self.dataplane.transport_names(),
            features=(*integrity.features(self.config, self.dataplane.on_device), *ROOM_FEATURES),
        )

    def watch(self, channel: Channel, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(why)`` once ``channel``'s peer is lost (see :class:`PeerWatch`)."""
        self.peer_watch.watch(channel, on_lost)

    async def _timers(self) -> None:
        tick = min(self.config.heartbeat_interval_s, 0.1)
        now = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now, slept_from = time.monotonic(), now
            stalled = self.stalls.tick(slept_from, now)
            if stalled:
                self.observe.loop_stalled(stalled)
            self.rooms.expire(now, self.side.on_timeout)
            if self.geometry is not None:
                self.side.on_tick(now)
            await self.peer_watch.tick(now)
