"""The decode side: request rooms from prefill instances, end them, drain aborts.

``expect(room, bootstrap, ...)`` takes the prefill instance of ``bootstrap``,
resolved once per address (:mod:`.prefill_instances`: rank table, reconciled
with this rank, a session and a Verdict per prefill rank; a rejected pair
fails its rooms at once with the full diagnostic, never after a timeout).
Then each needed prefill rank gets a TransferRequest; the room succeeds when
every one of them reported Done. Abort is fenced: the worker is told the
pages are safe to reuse only after every prefill rank acknowledged that no
write of the room's generation can still land.

Same-host rooms also end through a doorbell the sources ring, which the
worker's ``wait`` sleeps on (:mod:`pd_transfer.agent.decode.bells`).

Sessions are released, never only replaced (:mod:`.retire`). A room waits for
a slot under ``max_rooms_per_peer`` (per prefill instance,
:mod:`pd_transfer.agent.admission`) before its requests go out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pd_transfer.agent import integrity
from pd_transfer.agent.decode import abandon
from pd_transfer.agent.decode.bells import RoomBells
from pd_transfer.agent.decode.prefill_instances import PrefillInstances
from pd_transfer.agent.decode.room import DecodeRoom, PrefillInstance, PrefillPeer
from pd_transfer.agent.indices import Claims, check_indices
from pd_transfer.agent.rooms import Room
from pd_transfer.agent.side import not_served
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import (
    CONFIRM_DONE,
    Abort,
    AbortAck,
    Done,
    DoneStatus,
    PoolIndices,
    Progress,
    RoomStatus,
    TransferRequest,
)
from pd_transfer.protocol.worker_api import WorkerOp
from pd_transfer.protocol.worker_requests import AbandonRequest, ExpectRequest, LayerReadyRequest, SendRequest

if TYPE_CHECKING:
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.layout.geometry import RankGeometry
    from pd_transfer.transport.copy.checksums import BlockLayout

log = logging.getLogger(__package__)


class DecodeSide:
    def __init__(self, ctx: SideContext[DecodeRoom]) -> None:
        self.ctx = ctx
        self.bells = RoomBells(ctx.config, ctx.observe)
        self.prefill = PrefillInstances(ctx, self.bells, self._on_room_message, self._on_peer_lost)
        self.claims = Claims()  # the destination pages and slots of the live rooms
        self.table_ready = asyncio.Event()  # decode serves no rank table (the Side protocol)
        self.table_ready.set()

    @property
    def config(self) -> SidecarConfig:
        return self.ctx.config

    # -- the Side protocol (agent/side.py) ------------------------------------------
    async def on_send(self, request: SendRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        raise not_served(WorkerOp.SEND, "decode")

    async def on_layer_ready(self, request: LayerReadyRequest) -> dict[str, Any]:
        raise not_served(WorkerOp.LAYER_READY, "decode")

    def before_registering(self, geometry: RankGeometry) -> None:
        pass  # decode binds nothing for a registration before it is committed

    def registration_failed(self) -> None:
        pass

    async def on_registered(self) -> None:
        self.prefill.resolve_configured()

    async def on_worker_lost(self, why: str) -> None:
        text = f"the decode worker is gone ({why})"
        for room in self.ctx.rooms.live():
            self.fail_room(room, Reason.WORKER_LOST, f"room {room.room}: {text}")
        await self.prefill.release_all(text)

    def on_tick(self, now_s: float) -> None:
        self.prefill.resolve_configured()
        self.prefill.release_retired(now_s)

    # -- prefill instances ---------------------------------------------------------
    def instance_problem(self, address: str) -> str:
        return self.prefill.problem(address)

    # -- rooms --------------------------------------------------------------------
    async def on_expect(self, request: ExpectRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        existing = self.ctx.rooms.get(request.room)
        if existing is not None and not existing.terminal:
            raise PdTransferError(f"room {request.room} is already expected", code=Reason.DUPLICATE_ROOM)
        # refused here, with the field: never accepted to fail later at its timeout
        check_indices(pools, self.ctx.registered().geometry, side="destination", unique=True)
        held = request.held_pages
        if held > len(pools.get(Pool.KV, ())):
            raise PdTransferError(
                f"at $.held_pages: {held} held pages, but the room names {len(pools.get(Pool.KV, ()))} kv pages",
                code=Reason.BAD_FIELD,
            )
        # a room whose writers all rang has succeeded, and its worker may have seen the
        # doorbell (and reused the pages) before this sidecar saw the Done: settle it first
        for holder in self.claims.holders(pools):
            other = self.ctx.rooms.get(holder)
            if isinstance(other, DecodeRoom) and self.bells.rung(other):
                self._succeed(other)
        self.claims.claim(request.room, pools)
        room = DecodeRoom(
            request.room,
            self.ctx.next_generation(),
            bootstrap=request.bootstrap,
            dst=pools,
            held_pages=held,
        )
        room.on_end.append(lambda ended: self.claims.release(room.room, room.dst))  # ended is room
        # a little longer than resolving may take, so its own, more precise error wins
        room.deadline_s = time.monotonic() + self.config.bootstrap_timeout_s * 1.25 + 0.5
        self.ctx.rooms.add(room)
        reply = room.reply()
        doorbell = self.bells.arm(room)
        if doorbell is not None:
            reply["doorbell"] = doorbell
        self.ctx.spawn(self._start(room), room=room.room)
        return reply

    def on_abandon(self, request: AbandonRequest) -> dict[str, Any]:
        """The worker will never expect this room: its prefill instance is told (:mod:`.abandon`)."""
        room_id = request.room
        existing = self.ctx.rooms.get(room_id)
        if existing is not None and not existing.terminal:
            raise PdTransferError(
                f"room {room_id} is expected here; abort it instead of abandoning it",
                code=Reason.DUPLICATE_ROOM,
            )
        why = request.reason or "no reason given"
        text = f"room {room_id}: decode {self.config.agent_id} will never claim it: {why}"
        log.info("decode: %s", text, extra={"room": room_id, "peer": request.bootstrap})
        self.ctx.observe.abort("decode", Reason.ABORTED.value)
        self.ctx.spawn(abandon.tell_prefill(self.prefill, request.bootstrap, room_id, text), room=room_id)
        return {}

    async def _start(self, room: DecodeRoom) -> None:
        """Resolve, admit and request the room; whatever goes wrong ends it at once with
        the real reason (never at its timeout as "prefill peers were not resolved")."""
        try:
            await self._request(room)
        except PdTransferError as err:
            self.fail_room(room, err.code, f"room {room.room}: {err.message}", drained=not room.requested)
        except Exception as err:  # a bug here: the room still ends now, with what it was
            log.exception("decode: room %s: internal error", room.room)
            self.fail_room(
                room,
                Reason.TRANSPORT_FAILED,
                f"room {room.room}: internal error in the decode sidecar: {err!r}",
                drained=not room.requested,
            )

    async def _request(self, room: DecodeRoom) -> None:
        try:
            instance = await self.prefill.usable(room.bootstrap)
        except PdTransferError as err:
            text = f"room {room.room}: {err.message}"
            if err.code is Reason.PEER_REJECTED:  # prefill's room fails with the same text
                self.prefill.rejected.refuse_room(room.bootstrap, room.room, text)
            self.fail_room(room, err.code, text, drained=True)
            return
        except Exception as err:  # e.g. a bad address: report it on the room
            self.fail_room(
                room,
                Reason.BOOTSTRAP_FAILED,
                f"room {room.room}: bootstrap {room.bootstrap} failed: {err!r}",
                drained=True,
            )
            return
        if room.terminal:
            return
        room.instance = instance
        room.sources = list(instance.sources)
        try:  # nothing was requested yet: a room that cannot get a slot fails drained
            await self.ctx.admission.admit_room(f"prefill instance {room.bootstrap}", room)
        except PdTransferError as err:
            self.fail_room(room, err.code, f"room {room.room}: {err.message}", drained=True)
            return
        # tcp: the receiver admits this room's chunks, only into its pages, before prefill hears
        await self.ctx.dataplane.expect(room.room, room.generation, room.dst)
        if room.terminal:
            return
        request = TransferRequest(
            room=room.room,
            generation=room.generation,
            dst=tuple(PoolIndices(p, tuple(int(i) for i in idx)) for p, idx in room.dst.items()),
            src_ranks=tuple(room.sources),
            held_pages=room.held_pages,
        )
        writers = self.bells.writers(room, [instance.peers.get(rank) for rank in room.sources])
        room.requested = True
        for peer in instance.peers.values():
            writer = writers.get(peer.rank_id)
            await peer.channel.send(
                request
                if writer is None or room.bell is None  # writers come only with the room's bell
                else dataclasses.replace(request, doorbell=(*room.bell, writer))
            )
        room.advance(RoomStatus.WAITING_FOR_INPUT, time.monotonic() + self.config.waiting_timeout_s)

    def _on_room_message(self, peer: PrefillPeer, message: Done | Progress | AbortAck) -> None:
        room = self.ctx.rooms.get(message.room)
        if not isinstance(room, DecodeRoom) or message.generation != room.generation:
            return  # stale: an earlier generation of the room
        if isinstance(message, Progress):
            room.advance(RoomStatus.TRANSFERRING, time.monotonic() + self.config.transfer_timeout_s)
        elif isinstance(message, AbortAck):
            room.acks.add(peer.rank_id)
            if room.acks >= set(room.sources):
                room.drained.set()
        elif message.status is DoneStatus.SUCCESS and peer.integrity is not None:
            verify = self._verify(room, peer, peer.integrity, message)
            self.ctx.spawn(verify, room=room.room, peer=peer.rank_id)
        elif message.status is DoneStatus.SUCCESS:
            self._source_done(room, peer.rank_id)
        else:
            # this prefill rank wrote nothing more; the others may still be writing
            room.done_from.add(peer.rank_id)
            room.acks.add(peer.rank_id)
            # a failed Done carries its reason (the wire checks it: protocol/schema.py)
            reason = message.reason or Reason.UNRECOGNIZED_REASON
            self.fail_room(room, reason, f"room {room.room}: {peer.rank_id}: {message.reason_text}")

    def _source_done(self, room: DecodeRoom, rank_id: str) -> None:
        room.done_from.add(rank_id)
        if room.done_from >= set(room.sources):
            self._succeed(room)

    def _succeed(self, room: DecodeRoom) -> None:
        if room.terminal:
            return
        truncated = self.ctx.dataplane.local_truncated()
        if truncated is not None:  # the pages it landed in are zeros here, not the worker's
            self._fail_truncated(room, truncated)
            return
        room.advance(RoomStatus.SUCCESS)
        self.ctx.dataplane.forget(room.room)  # tcp: its later chunks are refused
        room.drained.set()
        self.ctx.spawn(self._confirm(room), room=room.room)
        for source in room.sources:
            self.ctx.observe.transfer_done(source, 0, 0, time.monotonic() - room.created_s)

    async def _confirm(self, room: DecodeRoom) -> None:
        """Tell each source this rank has the room's bytes: prefill's Success waits for it
        (its worker may free the source pages then). Only to peers that speak it."""
        peers = room.instance.peers if room.instance is not None else {}
        message = Done(room=room.room, generation=room.generation, status=DoneStatus.SUCCESS)
        for rank_id in room.sources:
            peer = peers.get(rank_id)
            hello = peer.channel.session.their_hello if peer is not None else None
            if peer is None or hello is None or CONFIRM_DONE not in hello.capabilities.features:
                continue
            try:
                await peer.channel.send(message)
            except Exception as err:  # its session ended: prefill fails the room itself
                log.warning("decode: cannot confirm room %d to %s: %s", room.room, rank_id, err)

    def check_bell(self, room: Room) -> None:
        """A poll or wait of the worker: a room every writer rang has succeeded, Done or not."""
        if isinstance(room, DecodeRoom) and self.bells.rung(room):
            self._succeed(room)

    def close(self) -> None:
        self.bells.close()

    async def _verify(self, room: DecodeRoom, peer: PrefillPeer, layout: BlockLayout, message: Done) -> None:
        """Count a source done only once what it wrote matches its checksums (``layout``'s)."""
        try:
            problem = await integrity.verify(
                layout, room.dst, message.checksums, self.ctx.dataplane.local_regions
            )
        except Exception as err:  # the room ends now, with why, not at its timeout
            log.exception("decode: room %s: verifying %s failed", room.room, peer.rank_id)
            problem = f"the check itself failed: {err!r}"
        if not problem or room.terminal:
            self._source_done(room, peer.rank_id)
            return
        room.done_from.add(peer.rank_id)
        room.acks.add(peer.rank_id)  # it wrote all it will: nothing of it to drain
        self.fail_room(
            room,
            Reason.INTEGRITY_MISMATCH,
            f"room {room.room}: integrity mismatch in what {peer.rank_id} wrote: {problem}",
        )

    def _fail_truncated(self, room: DecodeRoom, truncated: PdTransferError) -> None:
        if room.fail(truncated.code, f"room {room.room}: {truncated.message}"):
            log.warning(
                "decode: room %d: %s",
                room.room,
                truncated.message,
                extra={"room": room.room, "peer": ",".join(room.sources) or "-"},
            )
            for source in room.sources or ["-"]:
                self.ctx.observe.transfer_failed(source, truncated.code.value)
            room.drained.set()  # every source finished: nothing of it is left to land

    def fail_room(self, room: DecodeRoom, reason: Reason, text: str, *, drained: bool = False) -> None:
        if self.bells.landed(room):
            # every writer rang before this verdict: the bytes landed, and the worker
            # may have been told so already
            self._succeed(room)
            return
        if not room.fail(reason, text):
            return
        log.warning(
            "decode: %s", text, extra={"room": room.room, "peer": ",".join(room.sources) or room.bootstrap}
        )
        for source in room.sources or ["-"]:
            if source not in room.done_from or reason is not Reason.ABORTED:
                self.ctx.observe.transfer_failed(source, reason.value)
        # tcp: refuse any chunk of this generation that is still on its way
        self.ctx.spawn(self.ctx.dataplane.fence(room.room, room.generation), room=room.room)
        if drained or not room.sources:
            room.drained.set()
            return
        self.ctx.spawn(self._abort_sources(room, reason, text), room=room.room)

    async def _abort_sources(self, room: DecodeRoom, reason: Reason, text: str) -> None:
        """Fence the room: every prefill rank not yet finished must ack the abort."""
        pending = [
            p
            for p in (room.instance.peers if room.instance is not None else {}).values()
            if p.rank_id in room.sources and p.rank_id not in room.acks
        ]
        for peer in pending:
            try:
                await peer.channel.send(
                    Abort(room=room.room, generation=room.generation, reason=reason, reason_text=text[:4000])
                )
            except Exception as err:
                log.warning("decode: cannot send abort of room %d to %s: %s", room.room, peer.rank_id, err)
        if room.acks >= set(room.sources):
            room.drained.set()

    async def on_worker_abort(self, room_id: int) -> dict[str, Any]:
        room = self.ctx.rooms.get(room_id)
        if not isinstance(room, DecodeRoom):
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        if not room.terminal:
            self.ctx.observe.abort("decode", Reason.ABORTED.value)
        self.fail_room(room, Reason.ABORTED, f"room {room_id} aborted by the decode worker")
        try:
            async with asyncio.timeout(self.config.abort_drain_timeout_s):
                await room.drained.wait()
            # tcp chunks zmq had already queued must not land after we say "drained"
            async with asyncio.timeout(self.config.abort_drain_timeout_s):
                await self.ctx.dataplane.fence(room.room, room.generation)
            drained = True
        except TimeoutError:
            drained = False  # some prefill rank never confirmed: keep the pages fenced
        return {"drained": drained, **room.reply()}

    def on_timeout(self, room: DecodeRoom) -> None:
        waiting = {
            RoomStatus.BOOTSTRAPPING: "prefill peers were not resolved",
            RoomStatus.WAITING_FOR_INPUT: "prefill sent no data",
            RoomStatus.TRANSFERRING: "the transfer did not finish",
        }[room.status]
        self.fail_room(room, Reason.TIMEOUT, f"room {room.room} timed out in {room.status.value}: {waiting}")

    def _on_peer_lost(
        self, instance: PrefillInstance, peer: PrefillPeer, text: str, code: Reason = Reason.PEER_LOST
    ) -> None:
        for room in self.ctx.rooms.live():
            if isinstance(room, DecodeRoom) and room.instance is instance and peer.rank_id in room.sources:
                # not counted as drained: a silent peer might still write (fail closed)
                self.fail_room(room, code, f"room {room.room}: {text}")
