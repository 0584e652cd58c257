"""The decode side: bootstrap against a prefill instance, request rooms, drain aborts.

``expect(room, bootstrap, ...)`` resolves the prefill instance once per
bootstrap address: fetch the rank table, reconcile it with this rank, connect
to exactly the prefill ranks the plan needs, and wait for each one's Verdict.
A rejected pair fails its rooms at once with the full diagnostic, never after
a timeout. Then each needed prefill rank gets a TransferRequest; the room
succeeds when every one of them reported Done. Abort is fenced: the worker is
told the pages are safe to reuse only after every prefill rank acknowledged
that no write of the room's generation can still land.

Same-host rooms also end through a doorbell the sources ring, which the
worker's ``wait`` sleeps on (:mod:`pd_transfer.agent.room_bells`).

Sessions are released, never only replaced (:mod:`retire`). A room waits for
a slot under ``max_rooms_per_peer`` (per prefill instance,
:mod:`pd_transfer.agent.admission`) before its requests go out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pd_transfer.agent import integrity, retire
from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.agent.room_bells import RoomBells
from pd_transfer.agent.rooms import Room
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import (
    Abort,
    AbortAck,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    PoolIndices,
    Progress,
    RegionHandle,
    Register,
    RoomStatus,
    TransferRequest,
    Verdict,
)

log = logging.getLogger(__name__)


@dataclass
class PrefillPeer:
    rank_id: str
    channel: OutgoingChannel
    verdict: asyncio.Future
    integrity: object = None   # BlockLayout when its Done checksums are verified
    rings: bool = False        # its verdict: it rings this rank's doorbells


# a new room and a prefill connection that is down: how often to look, and how long
# past one heartbeat interval to wait for the timer tick that declares the rank lost
_DOWN_POLL_S = 0.02
_DOWN_SLACK_S = 0.25


@dataclass
class PrefillInstance:
    """One bootstrap address resolved: the prefill ranks this decode rank needs."""

    bootstrap: str
    peers: dict[str, PrefillPeer] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)   # the ranks that write to this rank
    error: PdTransferError | None = None
    lost: bool = False
    lost_s: float = 0.0                                  # when the first rank was lost
    lost_ranks: set[str] = field(default_factory=set)
    resolving: bool = True    # its resolution owns the sessions until it ends


@dataclass
class DecodeRoom(Room):
    bootstrap: str = ""
    dst: dict[Pool, np.ndarray] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    done_from: set[str] = field(default_factory=set)
    acks: set[str] = field(default_factory=set)
    instance: PrefillInstance | None = None
    bell: tuple[int, int] | None = None   # doorbell (slot, token)


class DecodeSide:
    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.instances: dict[str, asyncio.Task] = {}
        self.retired: list[PrefillInstance] = []   # lost: sessions to close once quiet
        self.bells = RoomBells(sidecar.config, sidecar.observe)

    @property
    def config(self):
        return self.sidecar.config

    # -- bootstrap --------------------------------------------------------------
    def _instance(self, bootstrap: str) -> asyncio.Task:
        task = self.instances.get(bootstrap)
        if task is not None and task.done() and (task.exception() or task.result().lost):
            task = None  # failed or lost: resolve again (a restarted prefill comes back)
        if task is None:
            task = self.instances[bootstrap] = asyncio.create_task(self._resolve(bootstrap))
        return task

    async def _usable_instance(self, bootstrap: str) -> PrefillInstance:
        """The resolved instance for a new room, never one with a connection known to be down.

        A connection to a prefill rank that closed (its process died, say) makes
        the rank lost after ``heartbeat_interval_s`` unless it comes back. A room
        started meanwhile would be sent into the dead session and fail with it; it
        waits for the outcome instead (polled, at most an interval and a tick) and,
        if the instance was lost, goes to its new resolution.
        """
        instance = await asyncio.shield(self._instance(bootstrap))
        deadline = time.monotonic() + self.config.heartbeat_interval_s + _DOWN_SLACK_S
        while (not instance.lost and time.monotonic() < deadline
               and any(p.channel.disconnected_s is not None for p in instance.peers.values())):
            await asyncio.sleep(_DOWN_POLL_S)
        if instance.lost:
            instance = await asyncio.shield(self._instance(bootstrap))
        return instance

    def resolve_configured(self) -> None:
        """Resolve the configured prefill instances ahead of traffic (and again once lost)."""
        for address in self.config.prefill_bootstraps:
            task = self.instances.get(address)
            if task is None or (task.done() and (task.cancelled() or task.exception()
                                                  or task.result().lost)):
                self._instance(address)

    def instance_problem(self, address: str) -> str:
        """Why ``address`` is not usable right now ('' when every peer accepted)."""
        task = self.instances.get(address)
        if task is None or not task.done():
            return "resolving (rank table, verdicts)"
        if task.cancelled():
            return "resolution cancelled"
        if task.exception() is not None:
            return str(task.exception())
        return "a prefill peer was lost; resolving again" if task.result().lost else ""

    async def _resolve(self, bootstrap: str) -> PrefillInstance:
        started = time.monotonic()
        try:
            return await self._resolve_once(bootstrap)
        finally:
            self.sidecar.observe.bootstrap(time.monotonic() - started)

    async def _resolve_once(self, bootstrap: str) -> PrefillInstance:
        sidecar = self.sidecar
        table = await fetch_table(sidecar.context, bootstrap, self.config.agent_id,
                                  self.config.bootstrap_timeout_s)
        geometry = sidecar.geometry
        recon = reconcile([e.geometry for e in table.entries], [geometry])
        instance = PrefillInstance(bootstrap)
        # even when this side already sees a mismatch, register anyway: prefill's
        # verdict is the authority, and it counts the rejection for its operators
        instance.sources = recon.sources_for(geometry) if recon.ok else []
        try:
            await self._connect_all(instance, table)
        except BaseException:
            asyncio.create_task(retire.close_sessions(instance))  # none left open behind
            raise
        finally:
            instance.resolving = False
        if not recon.ok:  # every prefill rank accepted what this side cannot plan: a bug
            asyncio.create_task(retire.close_sessions(instance))
            raise PdTransferError(str(recon.error()), code=Reason.PEER_REJECTED)
        integrity.attach_decode(self.sidecar, instance, recon, table)
        return instance

    async def _connect_all(self, instance: PrefillInstance, table) -> None:
        sidecar = self.sidecar
        # every prefill rank hears about every room, sources or not: a rank that
        # writes nothing to this decode rank still learns the room is done
        for entry in table.entries:
            rank_id = entry.geometry.rank_id
            channel = OutgoingChannel(sidecar.context, entry.control_address, Role.DECODE,
                                      f"{rank_id} ({entry.control_address})")
            channel.peer_rank = rank_id
            channel.on_bad_frame = sidecar.observe.bad_frame
            sidecar.observe.peer(rank_id, "connecting", channel=channel)
            peer = PrefillPeer(rank_id, channel, asyncio.get_running_loop().create_future())
            instance.peers[rank_id] = peer
            channel.start(lambda ch, msg, p=peer, i=instance: self._on_message(i, p, msg))
            await channel.send(Hello(agent_id=self.config.agent_id, role=Role.DECODE,
                                     capabilities=sidecar.capabilities()))
            sidecar.watch(channel, lambda why, i=instance, p=peer: self._on_lost(i, p, why))
        for peer in instance.peers.values():
            await self._await_verdict(peer)

    def release_retired(self, now_s: float) -> None:
        """Close the sessions of lost instances once quiet (timer tick; agent/retire.py)."""
        retire.release_retired(self, now_s)

    async def _await_verdict(self, peer: PrefillPeer) -> None:
        try:
            verdict = await asyncio.wait_for(asyncio.shield(peer.verdict), self.config.bootstrap_timeout_s)
        except TimeoutError:
            self.sidecar.observe.peer(peer.rank_id, "rejected", "no verdict in time", peer.channel)
            raise PdTransferError(f"no verdict from {peer.rank_id} within "
                                  f"{self.config.bootstrap_timeout_s:.1f} s",
                                  code=Reason.BOOTSTRAP_FAILED) from None
        self.sidecar.observe.verdict(verdict.accepted,
                                     verdict.mismatches[0].code.value if verdict.mismatches else "")
        if verdict.accepted:
            self.sidecar.observe.peer(peer.rank_id, "accepted", channel=peer.channel, transport="-",
                                      modes=[p.mode.value for p in verdict.plan])
            self.sidecar.observe.verdict_strategies(peer.rank_id, verdict.plan)
        if not verdict.accepted:
            self.sidecar.observe.peer(peer.rank_id, "rejected", verdict.headline, peer.channel)
            lines = [verdict.headline or f"{peer.rank_id} rejected this decode rank"]
            lines += [f"  - {m.render()}" for m in verdict.mismatches]
            hints = dict.fromkeys(m.hint for m in verdict.mismatches if m.hint)
            lines += [f"  hint: {h}" for h in hints]
            raise PdTransferError("\n".join(lines), code=Reason.PEER_REJECTED)

    async def _on_message(self, instance: PrefillInstance, peer: PrefillPeer, message) -> None:
        sidecar = self.sidecar
        if isinstance(message, Hello):
            await peer.channel.send(Register(
                agent_id=self.config.agent_id, host_id=self.config.host_id,
                geometry=sidecar.geometry, data_address=sidecar.dataplane.receive_address(),
                region_handles=tuple(RegionHandle(r, h) for r, h in sidecar.handles.items()),
                doorbell=self.bells.name))
        elif isinstance(message, Verdict):
            if not peer.verdict.done():
                peer.rings = message.doorbell and bool(self.bells.name)
                peer.verdict.set_result(message)
        elif isinstance(message, (Done, Progress, AbortAck)):
            self._on_room_message(peer, message)
        elif isinstance(message, (Register, Heartbeat)):
            pass

    # -- rooms --------------------------------------------------------------------
    async def on_expect(self, request: dict, pools: dict[Pool, np.ndarray]) -> dict:
        existing = self.sidecar.rooms.get(request["room"])
        if existing is not None and not existing.terminal:
            raise PdTransferError(f"room {request['room']} is already expected",
                                  code=Reason.DUPLICATE_ROOM)
        room = DecodeRoom(request["room"], self.sidecar.next_generation(), bootstrap=request["bootstrap"], dst=pools)
        # a little longer than resolving may take, so its own, more precise error wins
        room.deadline_s = time.monotonic() + self.config.bootstrap_timeout_s * 1.25 + 0.5
        self.sidecar.rooms.add(room)
        reply = room.reply()
        doorbell = self.bells.arm(room)
        if doorbell is not None:
            reply["doorbell"] = doorbell
        asyncio.create_task(self._start(room))
        return reply

    async def _start(self, room: DecodeRoom) -> None:
        try:
            instance = await self._usable_instance(room.bootstrap)
        except PdTransferError as err:
            self._fail(room, err.code, f"room {room.room}: {err.message}", drained=True)
            return
        except Exception as err:  # e.g. a bad address: report it on the room
            self._fail(room, Reason.BOOTSTRAP_FAILED, f"room {room.room}: bootstrap "
                       f"{room.bootstrap} failed: {err!r}", drained=True)
            return
        if room.terminal:
            return
        room.instance = instance
        room.sources = list(instance.sources)
        try:  # nothing was requested yet: a room that cannot get a slot fails drained
            await self.sidecar.admission.admit_room(f"prefill instance {room.bootstrap}", room)
        except PdTransferError as err:
            self._fail(room, err.code, f"room {room.room}: {err.message}", drained=True)
            return
        # tcp: the receiver admits this room's chunks, only into its pages, before prefill hears
        await self.sidecar.dataplane.expect(room.room, room.generation, room.dst)
        if room.terminal:
            return
        request = TransferRequest(room=room.room, generation=room.generation,
                                  dst=tuple(PoolIndices(p, tuple(int(i) for i in idx))
                                            for p, idx in room.dst.items()),
                                  src_ranks=tuple(room.sources))
        writers = self.bells.writers(room, [instance.peers.get(rank) for rank in room.sources])
        for peer in instance.peers.values():
            writer = writers.get(peer.rank_id)
            await peer.channel.send(request if writer is None else
                                    dataclasses.replace(request, doorbell=(*room.bell, writer)))
        room.advance(RoomStatus.WAITING_FOR_INPUT, time.monotonic() + self.config.waiting_timeout_s)

    def _on_room_message(self, peer: PrefillPeer, message) -> None:
        room = self.sidecar.rooms.get(message.room)
        if not isinstance(room, DecodeRoom) or message.generation != room.generation:
            return  # stale: an earlier generation of the room
        if isinstance(message, Progress):
            room.advance(RoomStatus.TRANSFERRING, time.monotonic() + self.config.transfer_timeout_s)
        elif isinstance(message, AbortAck):
            room.acks.add(peer.rank_id)
            if room.acks >= set(room.sources):
                room.drained.set()
        elif message.status is DoneStatus.SUCCESS and peer.integrity is not None:
            asyncio.create_task(self._verify(room, peer, message))
        elif message.status is DoneStatus.SUCCESS:
            self._source_done(room, peer.rank_id)
        else:
            # this prefill rank wrote nothing more; the others may still be writing
            room.done_from.add(peer.rank_id)
            room.acks.add(peer.rank_id)
            self._fail(room, message.reason, f"room {room.room}: {peer.rank_id}: {message.reason_text}")

    def _source_done(self, room: DecodeRoom, rank_id: str) -> None:
        room.done_from.add(rank_id)
        if room.done_from >= set(room.sources):
            self._succeed(room)

    def _succeed(self, room: DecodeRoom) -> None:
        if room.terminal:
            return
        room.advance(RoomStatus.SUCCESS)
        self.sidecar.dataplane.forget(room.room)  # tcp: its later chunks are refused
        room.drained.set()
        for source in room.sources:
            self.sidecar.observe.transfer_done(source, 0, 0, time.monotonic() - room.created_s)

    def check_bell(self, room: Room) -> None:
        """A poll or wait of the worker: a room every writer rang has succeeded, Done or not."""
        if self.bells.rung(room):
            self._succeed(room)

    def close(self) -> None:
        self.bells.close()

    async def _verify(self, room: DecodeRoom, peer: PrefillPeer, message: Done) -> None:
        """Count a source done only once what it wrote matches its checksums."""
        problem = await integrity.verify(peer.integrity, room.dst, message.checksums,
                                         self.sidecar.dataplane.local_regions)
        if not problem or room.terminal:
            self._source_done(room, peer.rank_id)
            return
        room.done_from.add(peer.rank_id)
        room.acks.add(peer.rank_id)  # it wrote all it will: nothing of it to drain
        self._fail(room, Reason.INTEGRITY_MISMATCH,
                   f"room {room.room}: integrity mismatch in what {peer.rank_id} wrote: {problem}")

    def _fail(self, room: DecodeRoom, reason: Reason, text: str, *, drained: bool = False) -> None:
        if self.bells.landed(room):
            # every writer rang before this verdict: the bytes landed, and the worker
            # may have been told so already
            self._succeed(room)
            return
        if not room.fail(reason, text):
            return
        log.warning("decode: %s", text,
                    extra={"room": room.room, "peer": ",".join(room.sources) or room.bootstrap})
        for source in room.sources or ["-"]:
            if source not in room.done_from or reason is not Reason.ABORTED:
                self.sidecar.observe.transfer_failed(source, reason.value)
        # tcp: refuse any chunk of this generation that is still on its way
        asyncio.create_task(self.sidecar.dataplane.fence(room.room, room.generation))
        if drained or not room.sources:
            room.drained.set()
            return
        asyncio.create_task(self._abort_sources(room, reason, text))

    async def _abort_sources(self, room: DecodeRoom, reason: Reason, text: str) -> None:
        """Fence the room: every prefill rank not yet finished must ack the abort."""
        pending = [p for p in room.instance.peers.values()
                   if p.rank_id in room.sources and p.rank_id not in room.acks]
        for peer in pending:
            try:
                await peer.channel.send(Abort(room=room.room, generation=room.generation,
                                              reason=reason, reason_text=text[:4000]))
            except Exception as err:
                log.warning("decode: cannot send abort of room %d to %s: %s", room.room, peer.rank_id, err)
        if room.acks >= set(room.sources):
            room.drained.set()

    async def on_worker_abort(self, room_id: int) -> dict:
        room = self.sidecar.rooms.get(room_id)
        if not isinstance(room, DecodeRoom):
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        if not room.terminal:
            self.sidecar.observe.abort("decode", Reason.ABORTED.value)
        self._fail(room, Reason.ABORTED, f"room {room_id} aborted by the decode worker")
        try:
            await asyncio.wait_for(room.drained.wait(), self.config.abort_drain_timeout_s)
            # tcp chunks zmq had already queued must not land after we say "drained"
            await asyncio.wait_for(self.sidecar.dataplane.fence(room.room, room.generation),
                                   self.config.abort_drain_timeout_s)
            drained = True
        except TimeoutError:
            drained = False  # some prefill rank never confirmed: keep the pages fenced
        return {"drained": drained, **room.reply()}

    def on_timeout(self, room: DecodeRoom) -> None:
        waiting = {RoomStatus.BOOTSTRAPPING: "prefill peers were not resolved",
                   RoomStatus.WAITING_FOR_INPUT: "prefill sent no data",
                   RoomStatus.TRANSFERRING: "the transfer did not finish"}[room.status]
        self._fail(room, Reason.TIMEOUT, f"room {room.room} timed out in {room.status.value}: {waiting}")

    def _on_lost(self, instance: PrefillInstance, peer: PrefillPeer, why: str) -> None:
        if not instance.lost:
            instance.lost, instance.lost_s = True, time.monotonic()
            self.retired.append(instance)
        instance.lost_ranks.add(peer.rank_id)
        text = f"lost prefill peer {peer.channel.label}: {why}"
        if not peer.verdict.done():
            peer.verdict.set_exception(PdTransferError(text, code=Reason.PEER_LOST))
        for room in self.sidecar.rooms.live():
            if isinstance(room, DecodeRoom) and room.instance is instance and peer.rank_id in room.sources:
                # not counted as drained: a silent peer might still write (fail closed)
                self._fail(room, Reason.PEER_LOST, f"room {room.room}: {text}")

