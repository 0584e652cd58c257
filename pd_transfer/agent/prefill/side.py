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
WaitingForInput, where SGLang waits forever. Writes are admitted by :mod:`.flow`
and made by the pumps of :mod:`.writes`; rooms end as :mod:`.endings` says.
A decode peer lost or sending Close fails its rooms and its link is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pd_transfer.agent.auth import security_of
from pd_transfer.agent.channels import CLOSE_SEND_TIMEOUT_S, Channel
from pd_transfer.agent.indices import check_indices
from pd_transfer.agent.peer_process import own_register_fields, peer_identity
from pd_transfer.agent.prefill import ownership
from pd_transfer.agent.prefill.acceptance import send_verdict
from pd_transfer.agent.prefill.chunks import chunk_refusal
from pd_transfer.agent.prefill.flow import refuse_new_room
from pd_transfer.agent.prefill.instances import DecodeInstances, instance_size
from pd_transfer.agent.prefill.membership import announce_first, join_instance
from pd_transfer.agent.prefill.records import DecodePeer, PrefillRoom, Target
from pd_transfer.agent.prefill.streaming import ChunkLayers, latest_streamed, span_of
from pd_transfer.agent.prefill.writes import PrefillWrites
from pd_transfer.agent.rooms import Room
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
from pd_transfer.wire.fields import clip_text

if TYPE_CHECKING:
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.observe import Observer
    from pd_transfer.agent.sidecar import Sidecar

log = logging.getLogger(__package__)


class PrefillSide(PrefillWrites):
    def __init__(self, sidecar: Sidecar[PrefillRoom]) -> None:
        super().__init__(sidecar)
        self.table: RankTable | None = None
        self.table_ready = asyncio.Event()
        self.decode_instances = DecodeInstances()  # registrations per decode instance
        self.rejections: dict[str, str] = {}  # decode rank -> its last rejection (acceptance.py)
        self.stale_peers: set[int] = set()  # decode sessions verdicted before the worker was lost

    # what the verdicts use of the sidecar (acceptance.Acceptor)
    @property
    def geometry(self) -> RankGeometry | None:
        return self.sidecar.geometry

    @property
    def dataplane(self) -> DataPlane:
        return self.sidecar.dataplane

    @property
    def observe(self) -> Observer:
        return self.sidecar.observe

    # -- the Side protocol (agent/side.py) ------------------------------------------
    async def on_worker_op(
        self, op: WorkerOp, request: dict[str, Any], pools: dict[Pool, np.ndarray]
    ) -> dict[str, Any]:
        if op is WorkerOp.SEND:
            return await self.on_send(request, pools)
        if op is WorkerOp.LAYER_READY:
            return await self.on_layer_ready(request)
        raise PdTransferError(f"{op.value} is not available on a prefill sidecar", code=Reason.BAD_FRAME)

    async def end_room(self, room: PrefillRoom, reason: Reason, text: str) -> None:
        await self.fail_room(room, reason, text)

    async def on_registered(self) -> None:
        sidecar = self.sidecar
        await self._close_stale_sessions()  # verdicts on a lost worker's registration
        if sidecar.bootstrap_server is not None and sidecar.bootstrap_server.gone:
            # rank 0's lost worker came back as another rank: its table is not this sidecar's
            sidecar.bootstrap_server.close()  # (its serve task ends with the socket)
            sidecar.bootstrap_server = None
        if sidecar.control is None:  # a prefill sidecar serves its control port before its worker
            raise PdTransferError("the control port is not served", code=Reason.NOT_REGISTERED)
        entry = RankEntry(
            agent_id=self.config.agent_id,
            host_id=self.config.host_id,
            control_address=sidecar.control.address,
            pp_size=sidecar.pp_size,
            geometry=sidecar.registered_geometry,
            control_key=security_of(sidecar.context).control_key,
        )
        await announce_first(sidecar.context, self.config, entry)
        sidecar.worker_tasks.append(sidecar.spawn(join_instance(sidecar.context, self.config, entry, self)))

    async def on_worker_lost(self, why: str) -> None:
        sidecar = self.sidecar
        text = f"the prefill worker is gone ({why})"
        # fail_room waits for each target's write in flight: no copy reads the regions after
        await asyncio.gather(
            *(
                self.fail_room(room, Reason.WORKER_LOST, f"room {room.room}: {text}")
                for room in sidecar.rooms.live()
            ),
            return_exceptions=True,
        )
        for task in sidecar.worker_tasks:
            task.cancel()
        sidecar.worker_tasks.clear()
        if sidecar.bootstrap_server is not None:  # rank 0: no table until its worker is back,
            # and whoever asks (past authentication) hears why at once (agent/bootstrap.py)
            sidecar.bootstrap_server.worker_lost(  # why: "worker W is gone: its connection ..."
                f"prefill rank 0's {why}; it serves no rank table until a worker registers with it again"
            )
        self.table = None
        self.table_ready.clear()
        self.stale_peers = {key for key, peer in self.peers.items() if peer.accepted}

    def instance_problem(self, address: str) -> str:
        return ""  # prefill resolves no prefill instance (prefill_bootstraps is decode's)

    def on_tick(self, now_s: float) -> None:
        pass  # prefill's periodic work is the sidecar's: heartbeats and room deadlines

    def check_bell(self, room: Room) -> None:
        pass  # prefill rings doorbells; it has none to read

    def close(self) -> None:
        pass

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
            self.release_peer(peer.channel, Reason.WORKER_LOST, f"decode peer {{}}: {text}")

    # -- decode sessions ----------------------------------------------------------
    async def on_peer_message(self, channel: Channel, message: Message) -> None:
        peer = self.peers.setdefault(id(channel), DecodePeer(channel))
        if isinstance(message, Hello):
            channel.peer_agent_id, peer.features = message.agent_id, message.capabilities.features
            await channel.send(
                Hello(
                    agent_id=self.config.agent_id, role=Role.PREFILL, capabilities=self.sidecar.capabilities()
                )
            )
        elif isinstance(message, Register):
            await self._on_register(peer, message)
        elif isinstance(message, TransferRequest):
            await self.on_request(peer, message)
        elif isinstance(message, RoomRefused):
            await self._on_refusal(peer, message)
        elif isinstance(message, Abort):
            await self._on_abort(peer, message)
        elif isinstance(message, Done):
            self._on_confirm(peer, message)
        elif isinstance(message, Heartbeat):
            pass  # last_heard_s is updated by the channel
        elif isinstance(message, Close):
            why = f"{message.reason.value}: {message.reason_text}" if message.reason else "no reason given"
            self.observe.left(peer.rank_id, f"it closed its session ({why})", channel)
            self.release_peer(channel, Reason.SESSION_CLOSED, "decode peer {} closed its session")
        else:
            log.debug("prefill: ignoring %s from %s", type(message).__name__, peer.rank_id)

    async def _on_register(self, peer: DecodePeer, message: Register) -> None:
        refusal = ownership.name_refusal(peer.channel, message)
        if refusal is not None:  # its rooms are bound to the names it gives
            code, text = refusal
            await peer.channel.send(Close(reason=code, reason_text=clip_text(text)))
            if code is Reason.IDENTITY_MISMATCH:
                self.sidecar.security.failed(PdTransferError(text, code=code), "control")
            self.release_peer(
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
        self.sidecar.observe.peer(message.geometry.rank_id, "connecting", channel=peer.channel)
        geometry = self.sidecar.geometry
        if geometry is None:  # worker not registered yet: wait for it, bounded
            await self.sidecar.wait_registered(self.config.bootstrap_timeout_s)
            geometry = self.sidecar.registered_geometry
        await peer.channel.send(
            Register(
                agent_id=self.config.agent_id,
                host_id=self.config.host_id,
                geometry=geometry,
                **own_register_fields(),
            )
        )
        self.sidecar.spawn(send_verdict(self, peer), peer=peer.rank_id)

    async def _on_refusal(self, peer: DecodePeer, message: RoomRefused) -> None:
        """A decode rank this rank rejected says the room was to be its
        (agent/decode/rejections.py), or an accepted one says it will never claim it
        (agent/decode/abandon.py): the room fails now with decode's text, not at its
        bootstrap timeout. A room another decode instance claimed, or its worker bound to
        one, is not this rank's to end."""
        room = self.sidecar.rooms.get(message.room)
        instance = ownership.instance_of(peer)
        others = isinstance(room, PrefillRoom) and (
            (room.owner and room.owner != instance)
            or any(not instance or ownership.instance_of(t.peer) != instance for t in room.targets.values())
        )
        if others or (room is not None and room.terminal):
            log.debug("prefill: room %d is not %s's to refuse", message.room, peer.rank_id)
            return
        room = self._room(message.room)
        room.refused = True  # the worker's send, when it comes, gets this failure
        self.sidecar.observe.abort("decode", message.reason.value)
        await self.fail_room(room, message.reason, message.reason_text)

    # -- rooms --------------------------------------------------------------------
    def _room(self, room_id: int) -> PrefillRoom:
        room = self.sidecar.rooms.get(room_id)
        if room is None or (room.terminal and not room.targets and not room.chunks and not room.refused):
            room = PrefillRoom(room_id, 0)
            room.deadline_s = time.monotonic() + self.config.bootstrap_timeout_s
            self.sidecar.rooms.add(room)
        return room

    async def on_request(self, peer: DecodePeer, message: TransferRequest) -> None:
        admitted = await self._admit_request(peer, message)
        if admitted is None:
            return
        room, target = admitted
        room.targets[id(peer.channel)] = target
        # every rank of the decode instance (every stage) sends each room's request to every prefill rank
        room.expected_targets = max(room.expected_targets, instance_size(peer.registered))
        if room.terminal:
            await self._finish_target(room, target)
            return
        if len(room.targets) >= room.expected_targets:
            room.advance(RoomStatus.WAITING_FOR_INPUT, time.monotonic() + self.config.waiting_timeout_s)
        self._pump_all(room)

    async def _admit_request(
        self, peer: DecodePeer, message: TransferRequest
    ) -> tuple[PrefillRoom, Target] | None:
        """The room and the new target ``message`` asks for, or None once it was refused
        (a failed Done to ``peer`` says why)."""
        sidecar = self.sidecar
        if await refuse_new_room(sidecar.rooms, sidecar.observe, self.config.agent_id, peer.channel, message):
            return None
        if sidecar.geometry is None:  # its worker is gone (agent/worker_loss.py)
            why = sidecar.worker.lost_reason or "the prefill worker is not registered"
            await _refuse(peer, message, Reason.WORKER_LOST, why)
            return None
        room = self._room(message.room)
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
        writes = sidecar.geometry.rank_id in message.src_ranks
        bell = message.doorbell if writes and peer.bells is not None else None
        # with integrity checks the checksums cover every page: held pages are written too
        held = message.held_pages if peer.integrity is None else 0
        return room, Target(peer, message.generation, dst, writes=writes, bell=bell, held=held)

    async def on_send(self, request: dict[str, Any], pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        try:  # against this rank's own pools, before a byte moves
            check_indices(pools, self.sidecar.registered_geometry, side="source", unique=False)
        except PdTransferError as err:
            # refused to the worker, and the room fails with it, so decode learns at once
            room = self._room(request["room"])
            room.refused = True
            await self.fail_room(room, err.code, f"room {room.room}: {err.message}")
            raise
        room = self._room(request["room"])
        if room.last_received:
            raise PdTransferError(f"room {room.room}: send after the last chunk", code=Reason.DUPLICATE_ROOM)
        if room.terminal:
            return room.reply()
        await ownership.bind(room, request["decode"], self.on_request)
        if chunk_refusal(self.config, room):
            self.sidecar.observe.limit_refused("max_chunks_per_room")
            await self.fail_room(room, Reason.OVER_LIMIT, chunk_refusal(self.config, room))
            return room.reply()
        room.chunks.append(pools)
        room.layers.append(
            ChunkLayers(span_of(self.sidecar.registered_geometry)) if request["stream"] else None
        )
        room.last_received = request["last"]
        self._pump_all(room)
        # the writes start before the reply goes: a small room (copied on the loop) is
        # copied and rung first. Replying first woke the worker, which on a busy host
        # took the CPU from this loop for a few hundred microseconds mid-room. A large
        # room's copy leaves for its thread at once, and the reply follows.
        await asyncio.sleep(0)
        return room.reply()

    async def on_layer_ready(self, request: dict[str, Any]) -> dict[str, Any]:
        room = self.sidecar.rooms.get(request["room"])
        if not isinstance(room, PrefillRoom):
            raise PdTransferError(f"room {request['room']} is unknown", code=Reason.UNKNOWN_ROOM)
        if not room.terminal:
            latest_streamed(room.layers, room.room).announce(room.room, request["layer_id"])
            self._pump_all(room)
        return room.reply()


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
