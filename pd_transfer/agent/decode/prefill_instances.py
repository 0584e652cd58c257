"""Decode: the prefill instances this rank takes rooms from, one per bootstrap address.

Resolving an instance: fetch its rank table, reconcile it with this rank, open a session to
every prefill rank (each hears about every room, writing or not), register, and wait for each
one's Verdict. A rejection fails with the full diagnostic, never after a timeout; an address
where nothing listens (every connection refused for a heartbeat limit, 5 s at least) fails then. A resolved
instance is reused by its address's rooms until one of its ranks is lost; the next room
resolves it anew, the lost one's sessions are retired (:mod:`.retire`), and while the address
has not answered since, a claim waits at most one heartbeat limit (:mod:`.gone`). A failed
resolution is tried again after a backoff (:mod:`pd_transfer.agent.retry`); until then rooms
fail with its error, and the readiness reason says when the next try is.

Room messages (Done, Progress, AbortAck) and a lost rank's rooms are the
decode side's (:mod:`.side`), handed over through two callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pd_transfer.agent import integrity
from pd_transfer.agent.auth import security_of
from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.agent.channels import OutgoingChannel
from pd_transfer.agent.decode import retire
from pd_transfer.agent.decode.bells import RoomBells
from pd_transfer.agent.decode.gone import LostAddresses
from pd_transfer.agent.decode.rejections import RejectedSessions
from pd_transfer.agent.decode.room import DecodeRoom, PrefillInstance, PrefillPeer
from pd_transfer.agent.peer_process import own_register_fields, peer_identity
from pd_transfer.agent.retry import Backoff
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.reconcile import reconcile
from pd_transfer.protocol import (
    AbortAck,
    Close,
    Done,
    Heartbeat,
    Hello,
    Progress,
    RegionHandle,
    Register,
    Verdict,
)

if TYPE_CHECKING:
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.config.sidecar import SidecarConfig
    from pd_transfer.protocol import Message, RankEntry, RankTable

log = logging.getLogger(__name__)


# a new room and a prefill connection that is down: how often to look, and how long
# past one heartbeat interval to wait for the timer tick that declares the rank lost
_DOWN_POLL_S = 0.02
_DOWN_SLACK_S = 0.25
_WORKER_BACK_CAP_S = 2.0  # rank 0 refused: its worker is gone, and registers again any moment


class PrefillInstances:
    """Every bootstrap address this rank was asked about, resolved or resolving."""

    def __init__(
        self,
        ctx: SideContext[DecodeRoom],
        bells: RoomBells,
        on_room_message: Callable[[PrefillPeer, Done | Progress | AbortAck], None],
        on_peer_lost: Callable[[PrefillInstance, PrefillPeer, str, Reason], None],
    ) -> None:
        self.ctx = ctx
        self.bells = bells
        self.instances: dict[str, asyncio.Task[PrefillInstance]] = {}
        self.backoffs: dict[str, Backoff] = {}  # per address: its failed resolutions
        self.retired: list[PrefillInstance] = []  # lost: sessions to close once quiet
        self.gone = LostAddresses(ctx.config.heartbeat_interval_s * ctx.config.heartbeat_misses)
        # to tell prefill the rooms it refuses
        self.rejected = RejectedSessions(ctx.spawn, ctx.config.bootstrap_timeout_s)
        self._on_room_message = on_room_message
        self._on_peer_lost = on_peer_lost

    @property
    def config(self) -> SidecarConfig:
        return self.ctx.config

    def resolved(self, bootstrap: str) -> asyncio.Task[PrefillInstance]:
        """The resolution of ``bootstrap``: started, running or done (a lost one is started
        again, and a failed one once its backoff has passed)."""
        task = self.instances.get(bootstrap)
        if task is not None and task.done():
            if task.cancelled():
                task = None
            elif task.exception() is not None:
                if self.backoffs[bootstrap].due(time.monotonic()):
                    task = None  # failed: try again (a restarted prefill comes back)
            elif task.result().lost:
                task = None
        if task is None:
            task = self.instances[bootstrap] = asyncio.create_task(self._resolve(bootstrap))
        return task

    async def usable(self, bootstrap: str) -> PrefillInstance:
        """The resolved instance for a new room, never one with a connection known to be down:
        a rank whose connection closed (its process died) is lost one ``heartbeat_interval_s``
        later unless it comes back; a room waits for that outcome rather than go into the dead
        session (polled, an interval and a tick at most), then to a new resolution if lost."""
        instance = await self.gone.wait(bootstrap, self.resolved(bootstrap))
        self._end_if_forgotten(instance)
        deadline = time.monotonic() + self.config.heartbeat_interval_s + _DOWN_SLACK_S
        while (
            not instance.lost
            and time.monotonic() < deadline
            and any(p.channel.disconnected_s is not None for p in instance.peers.values())
        ):
            await asyncio.sleep(_DOWN_POLL_S)
        if instance.lost:  # bounded while the address is known lost (.gone)
            instance = await self.gone.wait(bootstrap, self.resolved(bootstrap))
        return instance

    def _end_if_forgotten(self, instance: PrefillInstance) -> None:
        """A prefill rank that heard nothing from this rank for longer than its heartbeat
        limit (this process was stopped, SIGSTOP, or its loop stalled) has declared it
        lost and dropped the session, while this side, which discounts its own stalls,
        still holds it. A new room would go into that dead session and fail: new rooms
        go to a fresh resolution instead (new sessions). Rooms already on the old
        sessions keep them (retire.py closes them once quiet): if prefill did drop
        them, they fail through its Close or its silence, with that reason."""
        if instance.lost or instance.resolving:
            return
        limit_s = self.config.heartbeat_interval_s * self.config.heartbeat_misses
        now = time.monotonic()
        for peer in instance.peers.values():
            # silent now, or silent before the frame that ended the silence (a heartbeat
            # the timers sent on waking up, which the prefill answers with a Close)
            silent_s = max(now - peer.channel.last_sent_s, peer.channel.silent_gap_s)
            if silent_s > limit_s:
                log.info(
                    "decode: sent %s nothing for %.1f s (this process was stopped or "
                    "stalled); new rooms resolve prefill instance %s afresh",
                    peer.rank_id,
                    silent_s,
                    instance.bootstrap,
                )
                instance.lost, instance.lost_s = True, now
                self.retired.append(instance)
                return

    def resolve_configured(self) -> None:
        """Resolve the configured prefill instances ahead of traffic (and again once lost)."""
        for address in self.config.prefill_bootstraps:
            task = self.instances.get(address)
            if task is None or task.done():
                self.resolved(address)  # a failed one waits for its backoff there

    def problem(self, address: str) -> str:
        """Why ``address`` is not usable right now ('' when every peer accepted)."""
        task = self.instances.get(address)
        if task is None or not task.done():
            return "resolving (rank table, verdicts)"
        if task.cancelled():
            return "resolution cancelled"
        if task.exception() is not None:
            backoff = self.backoffs[address]
            return f"{backoff.describe(time.monotonic())}: {task.exception()}"
        return "a prefill peer was lost; resolving again" if task.result().lost else ""

    async def _resolve(self, bootstrap: str) -> PrefillInstance:
        started = time.monotonic()
        backoff = self.backoffs.setdefault(bootstrap, Backoff())
        try:
            instance = await self._resolve_once(bootstrap)
        except Exception as err:
            if isinstance(err, PdTransferError) and err.code is Reason.WORKER_LOST:
                backoff.cap_s = _WORKER_BACK_CAP_S  # rooms should not fail long after it is back
            backoff.failed(started, str(err))  # a try that timed out goes again at once
            log.log(
                logging.DEBUG if backoff.same_error else logging.WARNING,
                "decode: prefill instance %s: %s; %s",
                bootstrap,
                err,
                backoff.describe(time.monotonic()),
            )
            raise
        finally:
            self.ctx.observe.bootstrap(time.monotonic() - started)
        if backoff.failures:
            log.info(
                "decode: prefill instance %s resolved after %d failed tries", bootstrap, backoff.failures
            )
        del self.backoffs[bootstrap]  # kept only while failing
        self.rejected.drop(bootstrap)
        return instance

    async def _resolve_once(self, bootstrap: str) -> PrefillInstance:
        ctx = self.ctx
        table = await fetch_table(
            ctx.context,
            bootstrap,
            self.config.agent_id,
            self.config.bootstrap_timeout_s,
            refused_after_s=self.gone.grace_s,
        )
        self.gone.back(bootstrap)  # it answers: claims wait for the rest of the resolution
        geometry = ctx.registered().geometry
        # this rank's stage only: the decode instance's coverage is prefill's verdict
        recon = reconcile([e.geometry for e in table.entries], [geometry], require_all_prefill_layers=False)
        instance = PrefillInstance(bootstrap)
        # even when this side already sees a mismatch, register anyway: prefill's
        # verdict is the authority, and it counts the rejection for its operators
        instance.sources = recon.sources_for(geometry) if recon.ok else []
        try:
            await self._connect_all(instance, table)
        except BaseException as err:
            if isinstance(err, PdTransferError) and err.code is Reason.PEER_REJECTED:
                self.rejected.keep(bootstrap, instance)  # open until the next resolution
            else:
                self.ctx.spawn(retire.close_sessions(instance))  # none left open behind
            raise
        finally:
            instance.resolving = False
        if not recon.ok:  # every prefill rank accepted what this side cannot plan: a bug
            self.ctx.spawn(retire.close_sessions(instance))
            raise PdTransferError(str(recon.error()), code=Reason.PEER_REJECTED)
        integrity.attach_decode(
            ctx.config, ctx.dataplane.on_device, ctx.registered().geometry, instance, recon, table
        )
        return instance

    async def _connect_all(self, instance: PrefillInstance, table: RankTable) -> None:
        # every prefill rank hears about every room, sources or not: a rank that
        # writes nothing to this decode rank still learns the room is done
        for entry in table.entries:
            await self._open_session(instance, entry)
        for peer in instance.peers.values():
            await self._await_verdict(peer)

    async def _open_session(self, instance: PrefillInstance, entry: RankEntry) -> None:
        """A session to the prefill rank of ``entry``, said hello to, watched."""
        ctx = self.ctx
        rank_id = entry.geometry.rank_id
        key = security_of(ctx.context).listener_key(entry)  # AuthError: not that prefill
        where = f"{rank_id} ({entry.control_address})"
        channel = OutgoingChannel(ctx.context, entry.control_address, Role.DECODE, where, key)
        channel.peer_rank = rank_id
        channel.peer_limit_s = self.gone.grace_s  # this side's heartbeat limit stands for the peer's
        channel.on_bad_frame = ctx.observe.bad_frame
        ctx.observe.peer(rank_id, "connecting", channel=channel)
        peer = PrefillPeer(rank_id, channel, asyncio.get_running_loop().create_future())
        instance.peers[rank_id] = peer
        channel.on_refused = lambda ch: self._on_refused(instance, peer)
        channel.start(lambda ch, msg: self._on_message(instance, peer, msg))
        await channel.send(
            Hello(agent_id=self.config.agent_id, role=Role.DECODE, capabilities=ctx.capabilities())
        )
        ctx.watch(channel, lambda why: self._on_lost(instance, peer, why))

    async def release_all(self, text: str) -> None:
        """The worker is gone: close every session of every instance, resolved, resolving or
        retired, saying ``text``; its next worker resolves them afresh."""
        instances = list(self.retired)
        for task in self.instances.values():
            if not task.done():
                task.cancel()  # a resolution closes the sessions it opened
            elif not task.cancelled() and task.exception() is None:
                instances.append(task.result())
        self.instances.clear()
        self.retired.clear()
        self.rejected.drop_all()
        self.backoffs.clear()  # the next worker resolves its instances afresh
        for instance in instances:
            for peer in instance.peers.values():
                if not peer.channel.closed:
                    self.ctx.observe.left(peer.rank_id, f"session closed: {text}", peer.channel)
        await asyncio.gather(
            *(retire.close_sessions(instance) for instance in instances), return_exceptions=True
        )

    def release_retired(self, now_s: float) -> None:
        """Close the sessions of lost instances once quiet (timer tick; agent/decode/retire.py)."""
        retire.release_retired(self, self.ctx.rooms.rooms.values(), self.ctx.spawn, now_s)

    async def _await_verdict(self, peer: PrefillPeer) -> None:
        try:
            async with asyncio.timeout(self.config.bootstrap_timeout_s):
                verdict = await asyncio.shield(peer.verdict)
        except TimeoutError:
            self.ctx.observe.peer(peer.rank_id, "rejected", "no verdict in time", peer.channel)
            raise PdTransferError(
                f"no verdict from {peer.rank_id} within {self.config.bootstrap_timeout_s:.1f} s",
                code=Reason.BOOTSTRAP_FAILED,
            ) from None
        self.ctx.observe.verdict(
            verdict.accepted, verdict.mismatches[0].code.value if verdict.mismatches else ""
        )
        if verdict.accepted:
            self.ctx.observe.peer(
                peer.rank_id,
                "accepted",
                channel=peer.channel,
                transport=verdict.transport or "-",
                modes=[p.mode.value for p in verdict.plan],
            )
            self.ctx.observe.verdict_strategies(peer.rank_id, verdict.plan)
        if not verdict.accepted:
            lines = [verdict.headline or f"{peer.rank_id} rejected this decode rank"]
            lines += [f"  - {m.render()}" for m in verdict.mismatches]
            hints = dict.fromkeys(m.hint for m in verdict.mismatches if m.hint)
            lines += [f"  hint: {h}" for h in hints]
            # the whole diagnostic, every mismatch (status shows it; the headline alone hides it)
            self.ctx.observe.peer(peer.rank_id, "rejected", "\n".join(lines), peer.channel)
            raise PdTransferError("\n".join(lines), code=Reason.PEER_REJECTED)

    async def _on_message(self, instance: PrefillInstance, peer: PrefillPeer, message: Message) -> None:
        ctx = self.ctx
        if isinstance(message, Hello):
            registration = ctx.registered()
            await peer.channel.send(
                Register(
                    agent_id=self.config.agent_id,
                    host_id=self.config.host_id,
                    geometry=registration.geometry,
                    data_address=ctx.dataplane.receive_address(),
                    region_handles=tuple(RegionHandle(r, h) for r, h in registration.handles.items()),
                    doorbell=self.bells.name,
                    instance=self.config.instance_id,
                    pp_size=registration.pp_size,
                    **own_register_fields(),
                )
            )
        elif isinstance(message, Verdict):
            if not peer.verdict.done():
                peer.rings = message.doorbell and bool(self.bells.name)
                peer.verdict.set_result(message)
        elif isinstance(message, (Done, Progress, AbortAck)):
            self._on_room_message(peer, message)
        elif isinstance(message, Close):
            # the prefill rank ended the session (it lost this rank or its worker, or is shutting
            # down): the instance is resolved anew for the next room, and its rooms fail now
            why = f"{message.reason.value}: {message.reason_text}" if message.reason else "no reason given"
            self.ctx.observe.left(peer.rank_id, f"it closed its session ({why})", peer.channel)
            self._end(
                instance,
                peer,
                f"prefill peer {peer.channel.label} closed its session ({why})",
                message.reason or Reason.SESSION_CLOSED,
            )
        elif isinstance(message, Register):  # its process, watched where it is on this host
            peer.channel.peer_process = peer_identity(
                message.pid, message.process_start_ticks, message.host_id, self.config.host_id
            )
        elif isinstance(message, Heartbeat):
            pass

    def _on_lost(self, instance: PrefillInstance, peer: PrefillPeer, why: str) -> None:
        self._end(instance, peer, f"lost prefill peer {peer.channel.label}: {why}", Reason.PEER_LOST)

    def _on_refused(self, instance: PrefillInstance, peer: PrefillPeer) -> None:
        """This side closed the session over a bad frame from ``peer``: its rooms (and a
        verdict still awaited) fail now with that reason, and the instance is resolved
        afresh for the next room, as for a lost peer."""
        refusal = peer.channel.refusal  # set: the channel calls this once it refused (agent/channels.py)
        if refusal is None:
            return
        why = f"session closed after a bad frame from it: {refusal}"
        self.ctx.observe.lost(peer.rank_id, why, peer.channel, missed=False)
        self._end(instance, peer, f"prefill peer {peer.channel.label}: {why}", refusal.code)

    def _end(self, instance: PrefillInstance, peer: PrefillPeer, text: str, code: Reason) -> None:
        """``peer``'s session is over: the instance counts as lost (resolved again for
        the next room), and what waited on the peer fails with ``code`` and ``text``."""
        if not instance.lost:
            instance.lost, instance.lost_s = True, time.monotonic()
            self.retired.append(instance)
            self.gone.lost(instance.bootstrap, text, code)
        instance.lost_ranks.add(peer.rank_id)
        if not peer.verdict.done():
            peer.verdict.set_exception(PdTransferError(text, code=code))
        self._on_peer_lost(instance, peer, text, code)
