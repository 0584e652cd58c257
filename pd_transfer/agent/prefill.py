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
WaitingForInput, where SGLang waits forever. Writes are admitted by :mod:`flow`.
A decode peer lost or sending Close fails its rooms and its link is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from pd_transfer.agent import integrity, ownership
from pd_transfer.agent.acceptance import send_verdict
from pd_transfer.agent.channels import Channel
from pd_transfer.agent.chunks import chunk_refusal, chunk_requests
from pd_transfer.agent.dataplane import SegmentTruncated
from pd_transfer.agent.decode_instances import DecodeInstances, instance_size
from pd_transfer.agent.flow import peer_key, refuse_new_room, write_chunk
from pd_transfer.agent.indices import check_indices
from pd_transfer.agent.prefill_records import DecodePeer, PrefillRoom, Target
from pd_transfer.agent.rooms import Room
from pd_transfer.agent.streaming import ChunkLayers, chunk_plan, latest_streamed, span_of
from pd_transfer.agent.worker_loss import close_stale_sessions
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import (
    Abort,
    AbortAck,
    Close,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    Progress,
    RankTable,
    Register,
    RoomStatus,
    TransferRequest,
)
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.wire.fields import clip_text

log = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.peers: dict[int, DecodePeer] = {}
        self.table: RankTable | None = None
        self.table_ready = asyncio.Event()
        self.decode_instances = DecodeInstances()  # registrations per decode instance
        self.rejections: dict[str, str] = {}  # decode rank -> its last rejection (acceptance.py)

    @property
    def config(self):
        return self.sidecar.config

    # -- the Side protocol (agent/side.py) ------------------------------------------
    async def on_worker_op(self, op: WorkerOp, request: dict, pools: dict[Pool, np.ndarray]) -> dict:
        if op is WorkerOp.SEND:
            return await self.on_send(request, pools)
        if op is WorkerOp.LAYER_READY:
            return await self.on_layer_ready(request)
        raise PdTransferError(f"{op.value} is not available on a prefill sidecar", code=Reason.BAD_FRAME)

    async def end_room(self, room: PrefillRoom, reason: Reason, text: str) -> None:
        await self.fail_room(room, reason, text)

    async def on_registered(self) -> None:
        sidecar = self.sidecar
        await close_stale_sessions(sidecar)  # verdicts on a lost worker's registration
        await sidecar.announce_first()
        sidecar.worker_tasks.append(sidecar.spawn(sidecar.join_prefill_instance()))

    def on_tick(self, now_s: float) -> None:
        pass  # prefill's periodic work is the sidecar's: heartbeats and room deadlines

    def check_bell(self, room: Room) -> None:
        pass  # prefill rings doorbells; it has none to read

    def close(self) -> None:
        pass

    # -- decode sessions ----------------------------------------------------------
    async def on_message(self, channel: Channel, message) -> None:
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
        elif isinstance(message, Abort):
            await self._on_abort(peer, message)
        elif isinstance(message, Done):
            self._on_confirm(peer, message)
        elif isinstance(message, Heartbeat):
            pass  # last_heard_s is updated by the channel
        elif isinstance(message, Close):
            self.release_peer(channel, Reason.SESSION_CLOSED, "decode peer {} closed its session")
        else:
            log.debug("prefill: ignoring %s from %s", type(message).__name__, peer.rank_id)

    async def _on_register(self, peer: DecodePeer, message: Register) -> None:
        proven = peer.channel.proven_agent_id
        if proven and message.agent_id != proven:  # its rooms are bound to the names it gives
            await peer.channel.send(
                Close(
                    reason=Reason.AUTH_FAILED,
                    reason_text=clip_text(
                        f"registered as {message.agent_id!r} but authenticated as {proven!r}"
                    ),
                )
            )
            self.release_peer(
                peer.channel,
                Reason.AUTH_FAILED,
                "decode peer {} registered under another name than it proved",
            )
            return
        peer.register = message
        peer.channel.label = f"{message.geometry.rank_id} ({message.agent_id})"
        peer.channel.peer_rank = message.geometry.rank_id
        self.sidecar.observe.peer(message.geometry.rank_id, "connecting", channel=peer.channel)
        geometry = self.sidecar.geometry
        if geometry is None:  # worker not registered yet: wait for it, bounded
            await self.sidecar.wait_registered(self.config.bootstrap_timeout_s)
            geometry = self.sidecar.geometry
        await peer.channel.send(
            Register(agent_id=self.config.agent_id, host_id=self.config.host_id, geometry=geometry)
        )
        self.sidecar.spawn(send_verdict(self, peer), peer=peer.rank_id)

    # -- rooms --------------------------------------------------------------------
    def _room(self, room_id: int) -> PrefillRoom:
        room = self.sidecar.rooms.get(room_id)
        if room is None or (room.terminal and not room.targets and not room.chunks and not room.refused):
            room = PrefillRoom(room_id, 0)
            room.deadline_s = time.monotonic() + self.config.bootstrap_timeout_s
            self.sidecar.rooms.add(room)
        return room

    async def on_request(self, peer: DecodePeer, message: TransferRequest) -> None:
        if await refuse_new_room(self.sidecar, peer.channel, message):
            return
        if self.sidecar.geometry is None:  # its worker is gone (agent/worker_loss.py)
            await peer.channel.send(
                Done(
                    room=message.room,
                    generation=message.generation,
                    status=DoneStatus.FAILED,
                    reason=Reason.WORKER_LOST,
                    reason_text=self.sidecar.worker.lost_reason or "the prefill worker is not registered",
                )
            )
            return
        room = self._room(message.room)
        if not peer.accepted:
            await peer.channel.send(
                Done(
                    room=message.room,
                    generation=message.generation,
                    status=DoneStatus.FAILED,
                    reason=Reason.PEER_REJECTED,
                    reason_text="transfer request before an accepted verdict",
                )
            )
            return
        if not await ownership.admit_request(room, peer, message):
            return
        rank = peer.register.geometry.rank_id
        if any(
            t.peer.register.geometry.rank_id == rank and t.peer is not peer for t in room.targets.values()
        ) or (
            room.expected_targets
            and len(room.targets) >= room.expected_targets
            and id(peer.channel) not in room.targets
        ):
            # another peer already asked for this room as that rank (or every rank did):
            # a second decode instance must not receive this room's bytes
            await peer.channel.send(
                Done(
                    room=message.room,
                    generation=message.generation,
                    status=DoneStatus.FAILED,
                    reason=Reason.DUPLICATE_ROOM,
                    reason_text=f"room {message.room} already belongs to another decode peer as {rank}",
                )
            )
            return
        dst = {d.pool: np.asarray(d.indices, dtype=np.int64) for d in message.dst}
        try:  # against the pools the peer registered: refused before any byte moves
            check_indices(dst, peer.register.geometry, side="destination", unique=True)
        except PdTransferError as err:
            await peer.channel.send(
                Done(
                    room=message.room,
                    generation=message.generation,
                    status=DoneStatus.FAILED,
                    reason=err.code,
                    reason_text=f"room {message.room}: {err.message}"[:4000],
                )
            )
            return
        writes = self.sidecar.geometry.rank_id in message.src_ranks
        room.targets[id(peer.channel)] = Target(
            peer,
            message.generation,
            dst,
            writes=writes,
            bell=message.doorbell if writes and peer.bells is not None else None,
        )
        # every rank of the decode instance (every stage) sends each room's request to every prefill rank
        room.expected_targets = max(room.expected_targets, instance_size(peer.register))
        if room.terminal:
            await self._finish_target(room, room.targets[id(peer.channel)])
            return
        if len(room.targets) >= room.expected_targets:
            room.advance(RoomStatus.WAITING_FOR_INPUT, time.monotonic() + self.config.waiting_timeout_s)
        self._pump_all(room)

    async def on_send(self, request: dict, pools: dict[Pool, np.ndarray]) -> dict:
        try:  # against this rank's own pools, before a byte moves
            check_indices(pools, self.sidecar.geometry, side="source", unique=False)
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
        await ownership.bind(self, room, request["decode"])
        if chunk_refusal(self.config, room):
            self.sidecar.observe.limit_refused("max_chunks_per_room")
            await self.fail_room(room, Reason.OVER_LIMIT, chunk_refusal(self.config, room))
            return room.reply()
        room.chunks.append(pools)
        room.layers.append(ChunkLayers(span_of(self.sidecar.geometry)) if request["stream"] else None)
        room.last_received = request["last"]
        self._pump_all(room)
        # the writes start before the reply goes: a small room (copied on the loop) is
        # copied and rung first. Replying first woke the worker, which on a busy host
        # took the CPU from this loop for a few hundred microseconds mid-room. A large
        # room's copy leaves for its thread at once, and the reply follows.
        await asyncio.sleep(0)
        return room.reply()

    async def on_layer_ready(self, request: dict) -> dict:
        room = self.sidecar.rooms.get(request["room"])
        if not isinstance(room, PrefillRoom):
            raise PdTransferError(f"room {request['room']} is unknown", code=Reason.UNKNOWN_ROOM)
        if not room.terminal:
            latest_streamed(room.layers, room.room).announce(room.room, request["layer_id"])
            self._pump_all(room)
        return room.reply()

    def _pump_all(self, room: PrefillRoom) -> None:
        for target in list(room.targets.values()):
            self.sidecar.spawn(self._pump(room, target), room=room.room)

    async def _pump(self, room: PrefillRoom, target: Target) -> None:
        """Write what ``target`` can take now; anything that escapes (a bug) still ends
        the room at once, with what it was, never at its timeout."""
        try:
            await self._pump_target(room, target)
        except Exception as err:
            log.exception("prefill: room %s -> %s: internal error", room.room, target.peer.rank_id)
            await self.fail_room(
                room,
                Reason.TRANSPORT_FAILED,
                f"room {room.room} -> {target.peer.rank_id}: internal error in the prefill sidecar: {err!r}",
            )

    async def _pump_target(self, room: PrefillRoom, target: Target) -> None:
        async with target.lock:
            if not target.writes:
                if room.last_received and not target.done and not room.terminal:
                    target.done = True
                    self._maybe_succeed(room)
                return
            while target.chunks_done < len(room.chunks) and not target.failed and not room.terminal:
                index = target.chunks_done
                try:
                    requests = chunk_requests(room, target, index)
                    plan = await chunk_plan(self, room, target, index, requests)
                    if plan is None:
                        return  # streamed: the next layer_ready pumps again
                    room.advance(RoomStatus.TRANSFERRING, time.monotonic() + self.config.transfer_timeout_s)
                    nbytes = await write_chunk(self.sidecar, room, target, plan)
                    target.nbytes += nbytes
                    target.descriptors += plan.num_descriptors
                    await integrity.sum_chunk(target, requests, self.sidecar.dataplane.local_regions)
                except SegmentTruncated as err:
                    await self._on_truncated(room, target, err)
                    return
                except PdTransferError as err:
                    if not target.failed:  # else the abort of this target fails the room itself
                        await self.fail_room(
                            room,
                            err.code,
                            f"room {room.room} -> {target.peer.rank_id}: {err.message}",
                            lock_held=target,
                        )
                    return
                except Exception as err:  # a bug here: fail the room now, not at its timeout
                    log.exception("prefill: room %s -> %s: internal error", room.room, target.peer.rank_id)
                    if not target.failed:
                        await self.fail_room(
                            room,
                            Reason.TRANSPORT_FAILED,
                            f"room {room.room} -> {target.peer.rank_id}: internal "
                            f"error in the prefill sidecar: {err!r}",
                            lock_held=target,
                        )
                    return
                room.nbytes += nbytes
                target.kv_cursor += len(room.chunks[index].get(Pool.KV, ()))
                target.chunks_done, target.layers_sent = target.chunks_done + 1, set()
                if not (room.last_received and target.chunks_done == len(room.chunks)):
                    await self.send_quietly(
                        target,
                        Progress(
                            room=room.room,
                            generation=target.generation,
                            done_nbytes=room.nbytes,
                            total_nbytes=room.nbytes,
                        ),
                    )
            if (
                room.last_received
                and target.chunks_done == len(room.chunks)
                and not target.done
                and not target.failed
                and not room.terminal
            ):
                target.done = target.succeeded = True
                bells = target.peer.bells
                if target.bell is not None and bells is not None:
                    # the worker learns it here, Done tells its sidecar
                    self.sidecar.observe.doorbell("rang" if bells.ring(*target.bell) else "stale")
                    await asyncio.sleep(0)  # a send waiting on this copy replies before Done
                await self.send_quietly(
                    target,
                    Done(
                        room=room.room,
                        generation=target.generation,
                        status=DoneStatus.SUCCESS,
                        checksums=integrity.checksums(target),
                    ),
                )
                self.sidecar.observe.transfer_done(
                    target.peer.rank_id,
                    target.nbytes,
                    target.descriptors,
                    time.monotonic() - target.started_s,
                )
                self._maybe_succeed(room)

    async def _on_truncated(self, room: PrefillRoom, target: Target, err: SegmentTruncated) -> None:
        """A segment shrank under a write: the room fails with why; a decode peer that
        did it is dropped (its other rooms fail, its mapping goes), since what it left
        mapped is zeros, not its memory."""
        text = f"room {room.room} -> {target.peer.rank_id}: {err.message}"
        if not target.failed:
            await self.fail_room(room, err.code, text, lock_held=target)
        if not err.local and self.peers.get(id(target.peer.channel)) is target.peer:
            self.sidecar.observe.lost(target.peer.rank_id, err.message, target.peer.channel, missed=False)
            try:  # it learns why at once, and maps afresh on its next room
                await target.peer.channel.send(Close(reason=err.code, reason_text=err.message[:4000]))
            except Exception as failure:
                log.debug("prefill: no Close to %s: %s", target.peer.rank_id, failure)
            why = err.message.replace("{", "{{").replace("}", "}}")
            self.release_peer(target.peer.channel, err.code, f"decode peer {{}} dropped: {why}")

    async def send_quietly(self, target: Target, message) -> None:
        try:
            await target.peer.channel.send(message)
        except Exception as err:
            log.warning("prefill: cannot send %s to %s: %s", type(message).__name__, target.peer.rank_id, err)

    def _on_confirm(self, peer: DecodePeer, message: Done) -> None:
        """Decode has the room's bytes: what this side's Success waits for."""
        room = self.sidecar.rooms.get(message.room)
        target = room.targets.get(id(peer.channel)) if isinstance(room, PrefillRoom) else None
        if target is None or target.generation != message.generation:
            log.info(
                "prefill: confirmation of room %d from %s for no write of it", message.room, peer.rank_id
            )
            return
        target.confirmed = True
        self._maybe_succeed(room)

    def _maybe_succeed(self, room: PrefillRoom) -> None:
        # Success: every decode rank fed has the bytes (it confirmed), so the worker may
        # free its pages; bytes written but unconfirmed are not yet a success
        if (
            room.last_received
            and len(room.targets) >= room.expected_targets > 0
            and all(t.settled for t in room.targets.values())
        ):
            room.advance(RoomStatus.SUCCESS)

    async def fail_room(
        self, room: PrefillRoom, reason: Reason, text: str, lock_held: Target | None = None
    ) -> None:
        if not room.fail(reason, text):
            return
        await ownership.release_contenders(room, reason, text)
        peers = ",".join(t.peer.rank_id for t in room.targets.values()) or "-"
        log.warning("prefill: room %d failed: %s", room.room, text, extra={"room": room.room, "peer": peers})
        for target in room.targets.values():
            if target.writes and not target.succeeded:
                self.sidecar.observe.transfer_failed(target.peer.rank_id, reason.value)
        for target in list(room.targets.values()):
            if target is lock_held:
                await self._finish_target(room, target)
            else:
                async with target.lock:  # no write of this target in flight afterwards
                    await self._finish_target(room, target)
        room.drained.set()

    async def _finish_target(self, room: PrefillRoom, target: Target) -> None:
        if target.done or not target.writes:
            target.done = True
            return
        target.done = target.failed = True
        await self.send_quietly(
            target,
            Done(
                room=room.room,
                generation=target.generation,
                status=DoneStatus.FAILED,
                reason=room.state.reason or Reason.ABORTED,
                reason_text=room.state.reason_text or "room failed",
            ),
        )

    async def _on_abort(self, peer: DecodePeer, message: Abort) -> None:
        room = self.sidecar.rooms.get(message.room)
        target = room.targets.get(id(peer.channel)) if room else None
        if target is not None:
            self.sidecar.observe.abort("decode", message.reason.value)
            target.failed = True
            self.sidecar.admission.withdraw(room, peer_key(target))  # a queued write gives up now
            async with target.lock:  # wait for the write in flight, if any
                target.done = True
            if isinstance(room, PrefillRoom):
                await self.fail_room(
                    room, Reason.ABORTED, f"aborted by decode {peer.rank_id}: {message.reason_text}"
                )
        await peer.channel.send(AbortAck(room=message.room, generation=message.generation, drained=True))

    async def on_worker_abort(self, room_id: int) -> dict:
        room = self.sidecar.rooms.get(room_id)
        if room is None:
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        self.sidecar.observe.abort("prefill", Reason.ABORTED.value)
        await self.fail_room(room, Reason.ABORTED, f"room {room_id} aborted by the prefill worker")
        return {"drained": True, **room.reply()}

    def on_timeout(self, room: PrefillRoom) -> None:
        waiting = {
            RoomStatus.BOOTSTRAPPING: "no transfer request from decode",
            RoomStatus.WAITING_FOR_INPUT: "the prefill worker did not send the room's pages",
            RoomStatus.TRANSFERRING: "the transfer did not finish",
        }[room.status]
        if room.targets and all(t.done for t in room.targets.values()):
            waiting = "every byte was written, but decode did not confirm it has them"
        self.sidecar.spawn(
            self.fail_room(
                room, Reason.TIMEOUT, f"room {room.room} timed out in {room.status.value}: {waiting}"
            )
        )

    def on_peer_lost(self, channel: Channel, why: str) -> None:
        self.release_peer(channel, Reason.PEER_LOST, f"lost decode peer {{}}: {why}")

    def release_peer(self, channel: Channel, reason: Reason, text: str) -> None:
        """Forget a decode peer's session: its rooms fail with ``text`` (``{}``: the peer),
        and its link closes once their writes stopped."""
        peer = self.peers.pop(id(channel), None)
        channel.close()
        text = text.format(peer.rank_id if peer else channel.label)
        fails = [
            self.sidecar.spawn(self.fail_room(room, reason, text), room=room.room)
            for room in self.sidecar.rooms.live()
            if isinstance(room, PrefillRoom) and id(channel) in room.targets
        ]
        if peer is not None and peer.link is not None:
            link, peer.link = peer.link, None
            self.sidecar.spawn(self._close_link(link, fails, peer), peer=peer.rank_id)

    async def _close_link(self, link, fails: list[asyncio.Task], peer: DecodePeer) -> None:
        await asyncio.gather(*fails, return_exceptions=True)
        if peer.bells is not None:  # no write of its rooms is left to ring
            bells, peer.bells = peer.bells, None
            bells.close()
        await self.sidecar.dataplane.release(link)
