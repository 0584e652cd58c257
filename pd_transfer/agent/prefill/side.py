"""The prefill side: verdicts for decode peers, and executing rooms' plans.

A decode rank connects, says hello, registers its geometry; once the rank
table is complete this side reconciles the whole prefill instance with that
decode rank and answers an explicit Verdict (accepted with the plan summary,
or every mismatch) before any traffic. For each room it then waits for the
TransferRequests of every decode rank it feeds and for the worker's chunks,
and writes each chunk through the transport as soon as both are there. The
last chunk carries state slots, SWA pages and the aux row (written last: its
arrival means everything before it landed), then a Done goes out.

Prefill rooms have deadlines in every status, including after
WaitingForInput, where SGLang waits forever. The side is composed of its
collaborators: writes are admitted by :mod:`.flow` and made by the pumps of
:mod:`.writes`; rooms end as :mod:`.endings` says; rank 0's rank table server
is :mod:`.rank_table`'s, from bind to close. A decode peer lost or sending
Close fails its rooms and its link is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import numpy as np

from pd_transfer.agent.auth import security_of
from pd_transfer.agent.channels import CLOSE_SEND_TIMEOUT_S, Channel
from pd_transfer.agent.indices import check_indices
from pd_transfer.agent.peer_process import own_register_fields, peer_identity
from pd_transfer.agent.prefill import ownership
from pd_transfer.agent.prefill.acceptance import send_verdict
from pd_transfer.agent.prefill.decode_instances import DecodeInstances, instance_size
from pd_transfer.agent.prefill.endings import PrefillEndings
from pd_transfer.agent.prefill.flow import refuse_new_room
from pd_transfer.agent.prefill.membership import announce_first, join_instance
from pd_transfer.agent.prefill.rank_table import RankTableHost
from pd_transfer.agent.prefill.records import DecodePeer, PrefillRoom, Target
from pd_transfer.agent.prefill.sends import PrefillSends, open_room
from pd_transfer.agent.prefill.writes import PrefillWrites
from pd_transfer.agent.rooms import Room
from pd_transfer.agent.side import not_served
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import (
    Abort,
    Close,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    Message,
    RankEntry,
    RankTable,
    Register,
    RoomRefused,
    RoomStatus,
    TransferRequest,
)
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.protocol.worker_requests import AbandonRequest, ExpectRequest, LayerReadyRequest, SendRequest
from pd_transfer.wire.fields import clip_text

if TYPE_CHECKING:
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.observe import Observer
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.config.sidecar import SidecarConfig

log = logging.getLogger(__package__)


class PrefillSide:
    """The prefill role's :class:`~pd_transfer.agent.side.Side` and
    :class:`~pd_transfer.agent.side.PeerServer`: decode sessions, verdicts and the
    worker's sends here; its collaborators end rooms (``endings``), write them
    (``pumps``) and serve rank 0's rank table (``rank_table``)."""

    def __init__(self, ctx: SideContext[PrefillRoom]) -> None:
        self.ctx = ctx
        self.peers: dict[int, DecodePeer] = {}  # decode sessions, by id(channel)
        self.endings = PrefillEndings(ctx, self.peers)
        self.pumps = PrefillWrites(ctx, self.endings)
        self.sends = PrefillSends(ctx, self.endings, self.pumps, self.on_request)
        self.rank_table = RankTableHost(ctx)
        self.worker_tasks: list[asyncio.Task[Any]] = []  # what lives only while the worker is registered
        self.table: RankTable | None = None
        self.table_ready = asyncio.Event()
        self.decode_instances = DecodeInstances()  # registrations per decode instance
        self.rejections: dict[str, str] = {}  # decode rank -> its last rejection (acceptance.py)
        self.stale_peers: set[int] = set()  # decode sessions verdicted before the worker was lost

    # what the verdicts use of the sidecar (acceptance.Acceptor)
    @property
    def config(self) -> SidecarConfig:
        return self.ctx.config

    @property
    def geometry(self) -> RankGeometry | None:
        return self.ctx.geometry

    @property
    def dataplane(self) -> DataPlane:
        return self.ctx.dataplane

    @property
    def observe(self) -> Observer:
        return self.ctx.observe

    # -- the Side protocol (agent/side.py) ------------------------------------------
    async def on_send(self, request: SendRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        return await self.sends.on_send(request, pools)

    async def on_layer_ready(self, request: LayerReadyRequest) -> dict[str, Any]:
        return await self.sends.on_layer_ready(request)

    async def on_expect(self, request: ExpectRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        raise not_served(WorkerOp.EXPECT, "prefill")

    def on_abandon(self, request: AbandonRequest) -> dict[str, Any]:
        raise not_served(WorkerOp.ABANDON, "prefill")

    def fail_room(self, room: PrefillRoom, reason: Reason, text: str) -> Awaitable[None]:
        return self.endings.fail_room(room, reason, text)

    async def on_worker_abort(self, room_id: int) -> dict[str, Any]:
        return await self.endings.on_worker_abort(room_id)

    def on_timeout(self, room: PrefillRoom) -> None:
        self.endings.on_timeout(room)

    def before_registering(self, geometry: RankGeometry) -> None:
        self.rank_table.bind(geometry)

    def registration_failed(self) -> None:
        self.rank_table.unbind()

    async def on_registered(self) -> None:
        ctx = self.ctx
        self.rank_table.registered()
        await self._close_stale_sessions()  # verdicts on a lost worker's registration
        self.rank_table.drop_if_gone()
        control_address = ctx.control_address()
        if not control_address:  # a prefill sidecar serves its control port before its worker
            raise PdTransferError("the control port is not served", code=Reason.NOT_REGISTERED)
        registration = ctx.registered()
        entry = RankEntry(
            agent_id=self.config.agent_id,
            host_id=self.config.host_id,
            control_address=control_address,
            pp_size=registration.pp_size,
            geometry=registration.geometry,
            control_key=security_of(ctx.context).control_key,
        )
        await announce_first(ctx.context, self.config, entry)
        self.worker_tasks.append(ctx.spawn(join_instance(ctx.context, self.config, entry, self)))

    async def on_worker_lost(self, why: str) -> None:
        text = f"the prefill worker is gone ({why})"
        # fail_room waits for each target's write in flight: no copy reads the regions after
        await asyncio.gather(
            *(
                self.endings.fail_room(room, Reason.WORKER_LOST, f"room {room.room}: {text}")
                for room in self.ctx.rooms.live()
            ),
            return_exceptions=True,
        )
        for task in self.worker_tasks:
            task.cancel()
        self.worker_tasks.clear()
        self.rank_table.worker_lost(why)
        self.table = None
        self.table_ready.clear()
        self.stale_peers = {key for key, peer in self.peers.items() if peer.accepted}

    def on_peer_lost(self, channel: Channel, why: str) -> None:
        self.endings.on_peer_lost(channel, why)

    def on_peer_refused(self, channel: Channel) -> None:
        self.endings.on_peer_refused(channel)

    def instance_problem(self, address: str) -> str:
        return ""  # prefill resolves no prefill instance (prefill_bootstraps is decode's)

    def on_tick(self, now_s: float) -> None:
        pass  # prefill's periodic work is the sidecar's: heartbeats and room deadlines

    def check_bell(self, room: Room) -> None:
        pass  # prefill rings doorbells; it has none to read

    def close(self) -> None:
        self.rank_table.close()

    async def _close_stale_sessions(self) -> None:
        """Once a new registration is committed: the decode sessions verdicted on the lost
        worker's registration get a Close, and resolve this instance anew."""
        stale, self.stale_peers = self.stale_peers, set()
        text = "the prefill worker registered again: resolve this instance anew for a new verdict"
        for key in stale:
            peer = self.peers.get(key)
            if peer is None:
                continue
            try:
                async with asyncio.timeout(CLOSE_SEND_TIMEOUT_S):
                    await peer.channel.send(Close(reason=Reason.WORKER_LOST, reason_text=text))
            except Exception as err:  # a peer already gone: released all the same
                log.debug("prefill: no Close to %s: %s", peer.rank_id, err)
            self.observe.left(peer.rank_id, f"session closed: {text}", peer.channel)
            self.endings.release_peer(peer.channel, Reason.WORKER_LOST, f"decode peer {{}}: {text}")

    # -- decode sessions ----------------------------------------------------------
    async def on_peer_message(self, channel: Channel, message: Message) -> None:
        peer = self.peers.setdefault(id(channel), DecodePeer(channel))
        if isinstance(message, Hello):
            channel.peer_agent_id, peer.features = message.agent_id, message.capabilities.features
            await channel.send(
                Hello(agent_id=self.config.agent_id, role=Role.PREFILL, capabilities=self.ctx.capabilities())
            )
        elif isinstance(message, Register):
            await self._on_register(peer, message)
        elif isinstance(message, TransferRequest):
            await self.on_request(peer, message)
        elif isinstance(message, RoomRefused):
            await self._on_refusal(peer, message)
        elif isinstance(message, Abort):
            await self.endings.on_abort(peer, message)
        elif isinstance(message, Done):
            self.endings.on_confirm(peer, message)
        elif isinstance(message, Heartbeat):
            pass  # last_heard_s is updated by the channel
        elif isinstance(message, Close):
            why = f"{message.reason.value}: {message.reason_text}" if message.reason else "no reason given"
            self.observe.left(peer.rank_id, f"it closed its session ({why})", channel)
            self.endings.release_peer(channel, Reason.SESSION_CLOSED, "decode peer {} closed its session")
        else:
            log.debug("prefill: ignoring %s from %s", type(message).__name__, peer.rank_id)

    async def _on_register(self, peer: DecodePeer, message: Register) -> None:
        refusal = ownership.name_refusal(peer.channel, message)
        if refusal is not None:  # its rooms are bound to the names it gives
            code, text = refusal
            await peer.channel.send(Close(reason=code, reason_text=clip_text(text)))
            if code is Reason.IDENTITY_MISMATCH:
                self.ctx.security.failed(PdTransferError(text, code=code), "control")
            self.endings.release_peer(
                peer.channel, code, "decode peer {} registered under another name than it proved"
            )
            peer.channel.revoke()  # it authenticates again, on a new connection, or not at all
            return
        peer.register = message
        peer.channel.label = f"{message.geometry.rank_id} ({message.agent_id})"
        peer.channel.peer_rank = message.geometry.rank_id
        peer.channel.peer_process = peer_identity(
            message.pid, message.process_start_ticks, message.host_id, self.config.host_id
        )
        self.ctx.observe.peer(message.geometry.rank_id, "connecting", channel=peer.channel)
        geometry = self.ctx.geometry
        if geometry is None:  # worker not registered yet: wait for it, bounded
            await self.ctx.wait_registered(self.config.bootstrap_timeout_s)
            geometry = self.ctx.registered().geometry
        await peer.channel.send(
            Register(
                agent_id=self.config.agent_id,
                host_id=self.config.host_id,
                geometry=geometry,
                **own_register_fields(),
            )
        )
        self.ctx.spawn(send_verdict(self, peer), peer=peer.rank_id)

    async def _on_refusal(self, peer: DecodePeer, message: RoomRefused) -> None:
        """A decode rank this rank rejected says the room was to be its
        (agent/decode/rejections.py), or an accepted one says it will never claim it
        (agent/decode/abandon.py): the room fails now with decode's text, not at its
        bootstrap timeout. A room another decode instance claimed, or its worker bound to
        one, is not this rank's to end."""
        room = self.ctx.rooms.get(message.room)
        instance = ownership.instance_of(peer)
        others = isinstance(room, PrefillRoom) and (
            (room.owner and room.owner != instance)
            or any(not instance or ownership.instance_of(t.peer) != instance for t in room.targets.values())
        )
        if others or (room is not None and room.terminal):
            log.debug("prefill: room %d is not %s's to refuse", message.room, peer.rank_id)
            return
        room = open_room(self.ctx, message.room)
        room.refused = True  # the worker's send, when it comes, gets this failure
        self.ctx.observe.abort("decode", message.reason.value)
        await self.endings.fail_room(room, message.reason, message.reason_text)

    # -- rooms --------------------------------------------------------------------
    async def on_request(self, peer: DecodePeer, message: TransferRequest) -> None:
        admitted = await self._admit_request(peer, message)
        if admitted is None:
            return
        room, target = admitted
        room.targets[id(peer.channel)] = target
        # every rank of the decode instance (every stage) sends each room's request to every prefill rank
        room.expected_targets = max(room.expected_targets, instance_size(peer.registered))
        if room.terminal:
            await self.endings.finish_target(room, target)
            return
        if len(room.targets) >= room.expected_targets:
            room.advance(RoomStatus.WAITING_FOR_INPUT, time.monotonic() + self.config.waiting_timeout_s)
        self.pumps.pump_all(room)

    async def _admit_request(
        self, peer: DecodePeer, message: TransferRequest
    ) -> tuple[PrefillRoom, Target] | None:
        """The room and the new target ``message`` asks for, or None once it was refused
        (a failed Done to ``peer`` says why)."""
        ctx = self.ctx
        if await refuse_new_room(ctx.rooms, ctx.observe, self.config.agent_id, peer.channel, message):
            return None
        geometry = ctx.geometry
        if geometry is None:  # its worker is gone (agent/worker_loss.py)
            why = ctx.worker_lost_reason() or "the prefill worker is not registered"
            await _refuse(peer, message, Reason.WORKER_LOST, why)
            return None
        room = open_room(self.ctx, message.room)
        if not peer.accepted:
            await _refuse(peer, message, Reason.PEER_REJECTED, "transfer request before an accepted verdict")
            return None
        if not await ownership.admit_request(room, peer, message):
            return None
        text = ownership.duplicate(room, peer, self.peers, self.config.room_ttl_s)
        if text:
            # another session already asked for this room as that rank (or every rank did):
            # a second decode instance must not receive this room's bytes
            await _refuse(peer, message, Reason.DUPLICATE_ROOM, text)
            return None
        dst = {d.pool: np.asarray(d.indices, dtype=np.int64) for d in message.dst}
        try:  # against the pools the peer registered: refused before any byte moves
            check_indices(dst, peer.registered.geometry, side="destination", unique=True)
        except PdTransferError as err:
            await _refuse(peer, message, err.code, f"room {message.room}: {err.message}"[:4000])
            return None
        if message.held_pages > len(dst.get(Pool.KV, ())):
            text = f"room {message.room}: {message.held_pages} held pages of {len(dst.get(Pool.KV, ()))} kv pages"
            await _refuse(peer, message, Reason.BAD_FIELD, text)
            return None
        writes = geometry.rank_id in message.src_ranks
        bell = message.doorbell if writes and peer.bells is not None else None
        # with integrity checks the checksums cover every page: held pages are written too
        held = message.held_pages if peer.integrity is None else 0
        return room, Target(peer, message.generation, dst, writes=writes, bell=bell, held=held)


async def _refuse(peer: DecodePeer, message: TransferRequest, reason: Reason, text: str) -> None:
    """Answer a refused TransferRequest with a failed Done saying why."""
    await peer.channel.send(
        Done(
            room=message.room,
            generation=message.generation,
            status=DoneStatus.FAILED,
            reason=reason,
            reason_text=text,
        )
    )
