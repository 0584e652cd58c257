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
WaitingForInput, where SGLang waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pd_transfer.agent.channels import Channel
from pd_transfer.agent.rooms import Room
from pd_transfer.agent.verdicts import plan_summary
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.diagnostics import collapse
from pd_transfer.layout.fanout import decode_ranks_fed
from pd_transfer.layout.geometry import Role, handle_problems
from pd_transfer.layout.planner import PairPlanner
from pd_transfer.layout.reconcile import Reconciliation, reconcile
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import (
    Abort,
    AbortAck,
    Done,
    DoneStatus,
    Heartbeat,
    Hello,
    MismatchRecord,
    Progress,
    RankTable,
    Register,
    RoomStatus,
    TransferRequest,
    Verdict,
)

log = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    channel: Channel
    register: Register | None = None
    reconciliation: Reconciliation | None = None
    fed: list[int] = field(default_factory=list)
    link: object = None
    planner: PairPlanner | None = None
    accepted: bool = False

    @property
    def rank_id(self) -> str:
        return self.register.geometry.rank_id if self.register else self.channel.label


@dataclass
class Target:
    """One decode rank's request for a room."""

    peer: DecodePeer
    generation: int
    dst: dict[Pool, np.ndarray]
    writes: bool = True     # False: this rank writes nothing to that decode rank
    kv_cursor: int = 0
    chunks_done: int = 0
    nbytes: int = 0
    descriptors: int = 0
    started_s: float = field(default_factory=time.monotonic)
    done: bool = False
    succeeded: bool = False
    failed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class PrefillRoom(Room):
    chunks: list[dict[Pool, np.ndarray]] = field(default_factory=list)
    last_received: bool = False
    targets: dict[int, Target] = field(default_factory=dict)   # by channel id
    expected_targets: int = 0
    nbytes: int = 0


class PrefillSide:
    def __init__(self, sidecar) -> None:
        self.sidecar = sidecar
        self.peers: dict[int, DecodePeer] = {}
        self.table: RankTable | None = None
        self.table_ready = asyncio.Event()

    @property
    def config(self):
        return self.sidecar.config

    # -- decode sessions ----------------------------------------------------------
    async def on_message(self, channel: Channel, message) -> None:
        peer = self.peers.setdefault(id(channel), DecodePeer(channel))
        if isinstance(message, Hello):
            channel.peer_agent_id = message.agent_id
            await channel.send(Hello(agent_id=self.config.agent_id, role=Role.PREFILL,
                                     capabilities=self.sidecar.capabilities()))
        elif isinstance(message, Register):
            await self._on_register(peer, message)
        elif isinstance(message, TransferRequest):
            await self._on_request(peer, message)
        elif isinstance(message, Abort):
            await self._on_abort(peer, message)
        elif isinstance(message, Heartbeat):
            pass  # last_heard_s is updated by the channel
        else:
            log.debug("prefill: ignoring %s from %s", type(message).__name__, peer.rank_id)

    async def _on_register(self, peer: DecodePeer, message: Register) -> None:
        peer.register = message
        peer.channel.label = f"{message.geometry.rank_id} ({message.agent_id})"
        peer.channel.peer_rank = message.geometry.rank_id
        self.sidecar.observe.peer(message.geometry.rank_id, "connecting", channel=peer.channel)
        geometry = self.sidecar.geometry
        if geometry is None:  # worker not registered yet: wait for it, bounded
            await self.sidecar.wait_registered(self.config.bootstrap_timeout_s)
            geometry = self.sidecar.geometry
        await peer.channel.send(Register(agent_id=self.config.agent_id, host_id=self.config.host_id,
                                         geometry=geometry))
        asyncio.create_task(self._send_verdict(peer))

    async def _send_verdict(self, peer: DecodePeer) -> None:
        try:
            await asyncio.wait_for(self.table_ready.wait(), self.config.bootstrap_timeout_s)
        except TimeoutError:
            await self._reject(peer, "prefill rank table incomplete", [MismatchRecord(
                path="prefill.rank_table", code=Reason.BOOTSTRAP_FAILED, prefill="incomplete",
                decode="-", hint="start every prefill rank's sidecar and worker")])
            return
        decode_geometry = peer.register.geometry
        handles = {h.region: h.handle for h in peer.register.region_handles}
        problems = handle_problems(decode_geometry, handles) if handles else []
        if problems:
            await self._reject(peer, f"invalid registration of {peer.rank_id}", [MismatchRecord(
                path=f"decode.{p.subject or 'handles'}", code=p.code, prefill="-", decode=p.detail,
                hint="each region needs its own segment") for p in problems])
            return
        prefill = [e.geometry for e in self.table.entries]
        recon = reconcile(prefill, [decode_geometry])
        if not recon.ok:
            error = recon.error()
            await self._reject(peer, error.headline, [MismatchRecord.from_mismatch(m)
                                                      for m in collapse(list(recon.mismatches))])
            return
        peer.reconciliation = recon
        peer.planner = PairPlanner(recon, self.sidecar.geometry, decode_geometry)
        peer.fed = decode_ranks_fed(recon, self.sidecar.geometry.rank_id, decode_geometry)
        try:
            peer.link = await self.sidecar.dataplane.connect(peer.register)
        except PdTransferError as err:
            await self._reject(peer, f"no data plane to {peer.rank_id}", [MismatchRecord(
                path="transport", code=err.code, prefill=self.config.transport,
                decode=peer.register.data_address or "<no data address>", hint=str(err))])
            return
        peer.accepted = True
        observe = self.sidecar.observe
        modes = [v.mode.value for v in recon.verdicts]
        observe.peer(peer.rank_id, "accepted", channel=peer.channel,
                     transport=type(peer.link).__name__.removesuffix("Link").lower() or "-",
                     modes=modes)
        observe.verdict(True)
        observe.verdict_modes({m: modes.count(m) for m in set(modes)})
        log.info("prefill: accepted %s (feeds decode tp ranks %s)", peer.rank_id, peer.fed,
                 extra={"peer": peer.rank_id})
        await peer.channel.send(Verdict(accepted=True, plan=plan_summary(recon, peer.planner)))

    async def _reject(self, peer: DecodePeer, headline: str, mismatches: list[MismatchRecord]) -> None:
        self.sidecar.observe.peer(peer.rank_id, "rejected", headline, peer.channel)
        self.sidecar.observe.verdict(False, mismatches[0].code.value if mismatches else "")
        log.warning("prefill: rejected %s: %s", peer.rank_id,
                    "; ".join(m.render() for m in mismatches[:8]), extra={"peer": peer.rank_id})
        await peer.channel.send(Verdict(accepted=False, headline=headline, mismatches=tuple(mismatches)))

    # -- rooms --------------------------------------------------------------------
    def _room(self, room_id: int) -> PrefillRoom:
        room = self.sidecar.rooms.get(room_id)
        if room is None or (room.terminal and not room.targets and not room.chunks):
            room = PrefillRoom(room_id, 0)
            room.deadline_s = time.monotonic() + self.config.bootstrap_timeout_s
            self.sidecar.rooms.add(room)
        return room

    async def _on_request(self, peer: DecodePeer, message: TransferRequest) -> None:
        room = self._room(message.room)
        if not peer.accepted:
            await peer.channel.send(Done(room=message.room, generation=message.generation,
                                         status=DoneStatus.FAILED, reason=Reason.PEER_REJECTED,
                                         reason_text="transfer request before an accepted verdict"))
            return
        rank = peer.register.geometry.rank_id
        if any(t.peer.register.geometry.rank_id == rank and t.peer is not peer
               for t in room.targets.values()) or (
                room.expected_targets and len(room.targets) >= room.expected_targets
                and id(peer.channel) not in room.targets):
            # another peer already asked for this room as that rank (or every rank did):
            # a second decode instance must not receive this room's bytes
            await peer.channel.send(Done(room=message.room, generation=message.generation,
                                         status=DoneStatus.FAILED, reason=Reason.DUPLICATE_ROOM,
                                         reason_text=f"room {message.room} already belongs to "
                                                     f"another decode peer as {rank}"))
            return
        dst = {d.pool: np.asarray(d.indices, dtype=np.int64) for d in message.dst}
        writes = self.sidecar.geometry.rank_id in message.src_ranks
        room.targets[id(peer.channel)] = Target(peer, message.generation, dst, writes=writes)
        # every rank of the decode instance (PP 1) sends each room's request to every prefill rank
        room.expected_targets = max(room.expected_targets, peer.register.geometry.tp_size)
        if room.terminal:
            await self._finish_target(room, room.targets[id(peer.channel)])
            return
        if len(room.targets) >= room.expected_targets:
            room.advance(RoomStatus.WAITING_FOR_INPUT,
                         time.monotonic() + self.config.waiting_timeout_s)
        self._pump_all(room)

    async def on_send(self, request: dict, pools: dict[Pool, np.ndarray]) -> dict:
        room = self._room(request["room"])
        if room.last_received:
            raise PdTransferError(f"room {room.room}: send after the last chunk",
                                  code=Reason.DUPLICATE_ROOM)
        if room.terminal:
            return room.reply()
        room.chunks.append(pools)
        room.last_received = request["last"]
        self._pump_all(room)
        return room.reply()

    def _pump_all(self, room: PrefillRoom) -> None:
        for target in list(room.targets.values()):
            asyncio.create_task(self._pump(room, target))

    async def _pump(self, room: PrefillRoom, target: Target) -> None:
        async with target.lock:
            if not target.writes:
                if room.last_received and not target.done and not room.terminal:
                    target.done = True
                    self._maybe_succeed(room)
                return
            while target.chunks_done < len(room.chunks) and not target.failed and not room.terminal:
                index = target.chunks_done
                try:
                    requests = self._chunk_requests(room, target, index)
                    plan = target.peer.planner.plan(requests)
                    room.advance(RoomStatus.TRANSFERRING,
                                 time.monotonic() + self.config.transfer_timeout_s)
                    gauge = self.sidecar.observe.metrics.inflight_bytes.labels(
                        "prefill", target.peer.rank_id)
                    gauge.inc(plan.total_nbytes)
                    try:
                        nbytes = await self.sidecar.dataplane.write(target.peer.link, plan,
                                                                    room.room, target.generation)
                    finally:
                        gauge.dec(plan.total_nbytes)
                    target.nbytes += nbytes
                    target.descriptors += plan.num_descriptors
                except PdTransferError as err:
                    await self.fail_room(room, err.code, f"room {room.room} -> {target.peer.rank_id}: "
                                                         f"{err.message}", lock_held=target)
                    return
                room.nbytes += nbytes
                target.kv_cursor += len(room.chunks[index].get(Pool.KV, ()))
                target.chunks_done += 1
                if not (room.last_received and target.chunks_done == len(room.chunks)):
                    await self._send(target, Progress(room=room.room, generation=target.generation,
                                                      done_nbytes=room.nbytes,
                                                      total_nbytes=room.nbytes))
            if room.last_received and target.chunks_done == len(room.chunks) and not target.done \
                    and not target.failed and not room.terminal:
                target.done = target.succeeded = True
                await self._send(target, Done(room=room.room, generation=target.generation,
                                              status=DoneStatus.SUCCESS))
                self.sidecar.observe.transfer_done(target.peer.rank_id, target.nbytes,
                                                   target.descriptors,
                                                   time.monotonic() - target.started_s)
                self._maybe_succeed(room)

    def _chunk_requests(self, room: PrefillRoom, target: Target, index: int) -> dict:
        chunk = room.chunks[index]
        last = room.last_received and index == len(room.chunks) - 1
        requests = {}
        src_kv = chunk.get(Pool.KV, np.zeros(0, np.int64))
        dst_kv = target.dst.get(Pool.KV, np.zeros(0, np.int64))
        end = target.kv_cursor + len(src_kv)
        if end > len(dst_kv) or (last and end != len(dst_kv)):
            raise PdTransferError(f"prefill sends {end if end > len(dst_kv) else end} kv page(s) but "
                                  f"decode allocated {len(dst_kv)}; refused rather than truncated",
                                  code=Reason.INDEX_COUNT_MISMATCH)
        if len(src_kv):
            requests[Pool.KV] = (src_kv, dst_kv[target.kv_cursor:end])
        if last:
            for pool in (Pool.SWA, Pool.MAMBA, Pool.AUX):
                src, dst = chunk.get(pool), target.dst.get(pool)
                if src is None and dst is None:
                    continue
                if src is None or dst is None or len(src) != len(dst):
                    raise PdTransferError(
                        f"{pool.value}: prefill sends {0 if src is None else len(src)} index(es), "
                        f"decode expects {0 if dst is None else len(dst)}",
                        code=Reason.INDEX_COUNT_MISMATCH)
                requests[pool] = (src, dst)
            # aux goes last: its arrival means everything before it landed
            if Pool.AUX in requests:
                requests[Pool.AUX] = requests.pop(Pool.AUX)
        return requests

    async def _send(self, target: Target, message) -> None:
        try:
            await target.peer.channel.send(message)
        except Exception as err:
            log.warning("prefill: cannot send %s to %s: %s", type(message).__name__,
                        target.peer.rank_id, err)

    def _maybe_succeed(self, room: PrefillRoom) -> None:
        if room.last_received and len(room.targets) >= room.expected_targets > 0 \
                and all(t.done for t in room.targets.values()):
            room.advance(RoomStatus.SUCCESS)

    async def fail_room(self, room: PrefillRoom, reason: Reason, text: str,
                        lock_held: Target | None = None) -> None:
        if not room.fail(reason, text):
            return
        peers = ",".join(t.peer.rank_id for t in room.targets.values()) or "-"
        log.warning("prefill: room %d failed: %s", room.room, text,
                    extra={"room": room.room, "peer": peers})
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
        await self._send(target, Done(room=room.room, generation=target.generation,
                                      status=DoneStatus.FAILED, reason=room.state.reason or Reason.ABORTED,
                                      reason_text=room.state.reason_text or "room failed"))

    async def _on_abort(self, peer: DecodePeer, message: Abort) -> None:
        room = self.sidecar.rooms.get(message.room)
        target = room.targets.get(id(peer.channel)) if room else None
        if target is not None:
            self.sidecar.observe.abort("decode", message.reason.value)
            target.failed = True
            async with target.lock:  # wait for the write in flight, if any
                target.done = True
            if isinstance(room, PrefillRoom):
                await self.fail_room(room, Reason.ABORTED,
                                     f"aborted by decode {peer.rank_id}: {message.reason_text}")
        await peer.channel.send(AbortAck(room=message.room, generation=message.generation,
                                         drained=True))

    async def on_worker_abort(self, room_id: int) -> dict:
        room = self.sidecar.rooms.get(room_id)
        if room is None:
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        self.sidecar.observe.abort("prefill", Reason.ABORTED.value)
        await self.fail_room(room, Reason.ABORTED, f"room {room_id} aborted by the prefill worker")
        return {"drained": True, **room.reply()}

    def on_timeout(self, room: PrefillRoom) -> None:
        waiting = {RoomStatus.BOOTSTRAPPING: "no transfer request from decode",
                   RoomStatus.WAITING_FOR_INPUT: "the prefill worker did not send the room's pages",
                   RoomStatus.TRANSFERRING: "the transfer did not finish"}[room.status]
        asyncio.create_task(self.fail_room(
            room, Reason.TIMEOUT,
            f"room {room.room} timed out in {room.status.value}: {waiting}"))

    def on_peer_lost(self, channel: Channel, silent_s: float) -> None:
        peer = self.peers.pop(id(channel), None)
        label = peer.rank_id if peer else channel.label
        for room in self.sidecar.rooms.live():
            if isinstance(room, PrefillRoom) and id(channel) in room.targets:
                asyncio.create_task(self.fail_room(
                    room, Reason.PEER_LOST,
                    f"lost decode peer {label}: no heartbeat for {silent_s:.1f} s"))
