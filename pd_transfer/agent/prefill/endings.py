"""How a prefill room ends: success once decode confirmed, failure, abort, timeout.

A room succeeds when every decode rank it feeds holds its bytes (each target
:attr:`~pd_transfer.agent.prefill.records.Target.settled`). It fails once, with
one reason: every target that still writes gets a failed Done, after its
write in flight stopped (its lock). A decode peer lost or closed fails the
rooms that still need it (bytes to write to it, or its confirmation), not the
rooms whose part on it is settled, and its link closes once their writes
stopped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pd_transfer.agent.prefill import ownership
from pd_transfer.agent.prefill.flow import peer_key
from pd_transfer.agent.prefill.records import DecodePeer, PrefillRoom, Target, TargetState
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.protocol import Abort, AbortAck, Done, DoneStatus, Message, RoomStatus

if TYPE_CHECKING:
    from pd_transfer.agent.channels import Channel
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.transport.base import Link

log = logging.getLogger(__package__)


class PrefillEndings:
    """How the prefill side's rooms end, and its decode peers' sessions with them
    (a collaborator of :class:`~pd_transfer.agent.prefill.side.PrefillSide`, which
    shares ``peers`` with it)."""

    def __init__(self, ctx: SideContext[PrefillRoom], peers: dict[int, DecodePeer]) -> None:
        self.ctx = ctx
        self.peers = peers

    async def send_quietly(self, target: Target, message: Message) -> None:
        try:
            await target.peer.channel.send(message)
        except Exception as err:
            log.warning("prefill: cannot send %s to %s: %s", type(message).__name__, target.peer.rank_id, err)

    def on_confirm(self, peer: DecodePeer, message: Done) -> None:
        """Decode has the room's bytes: what this side's Success waits for."""
        room = self.ctx.rooms.get(message.room)
        target = room.targets.get(id(peer.channel)) if isinstance(room, PrefillRoom) else None
        if room is None or target is None or target.generation != message.generation:
            log.info(
                "prefill: confirmation of room %d from %s for no write of it", message.room, peer.rank_id
            )
            return
        target.confirmed = True
        self.maybe_succeed(room)

    def maybe_succeed(self, room: PrefillRoom) -> None:
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
                self.ctx.observe.transfer_failed(target.peer.rank_id, reason.value)
        for target in list(room.targets.values()):
            if target is lock_held:
                await self.finish_target(room, target)
            else:
                async with target.lock:  # no write of this target in flight afterwards
                    await self.finish_target(room, target)
        room.drained.set()

    async def finish_target(self, room: PrefillRoom, target: Target) -> None:
        if target.done or not target.writes:
            target.end()
            return
        target.state = TargetState.FAILED
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

    async def on_abort(self, peer: DecodePeer, message: Abort) -> None:
        room = self.ctx.rooms.get(message.room)
        target = room.targets.get(id(peer.channel)) if room else None
        if room is not None and target is not None:
            self.ctx.observe.abort("decode", message.reason.value)
            target.abort()
            self.ctx.admission.withdraw(room, peer_key(target))  # a queued write gives up now
            async with target.lock:  # wait for the write in flight, if any
                target.end()
            if isinstance(room, PrefillRoom):
                await self.fail_room(
                    room, Reason.ABORTED, f"aborted by decode {peer.rank_id}: {message.reason_text}"
                )
        await peer.channel.send(AbortAck(room=message.room, generation=message.generation, drained=True))

    async def on_worker_abort(self, room_id: int) -> dict[str, Any]:
        room = self.ctx.rooms.get(room_id)
        if room is None:
            raise PdTransferError(f"room {room_id} is unknown", code=Reason.UNKNOWN_ROOM)
        self.ctx.observe.abort("prefill", Reason.ABORTED.value)
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
        self.ctx.spawn(
            self.fail_room(
                room, Reason.TIMEOUT, f"room {room.room} timed out in {room.status.value}: {waiting}"
            )
        )

    def on_peer_lost(self, channel: Channel, why: str) -> None:
        self.release_peer(channel, Reason.PEER_LOST, f"lost decode peer {{}}: {why}")

    def on_peer_refused(self, channel: Channel) -> None:
        """This sidecar closed a decode peer's session over a bad frame: its rooms fail
        with that reason now (not at their timeout), and nothing of it is kept."""
        refusal = channel.refusal  # set: the channel calls this once it refused (agent/channels.py)
        if id(channel) not in self.peers or refusal is None:
            return  # refused at its first frame: it holds nothing (and rooms need no scan)
        self.ctx.observe.lost(
            channel.peer_rank or channel.label,
            f"session closed after a bad frame: {refusal}",
            channel,
            missed=False,
        )
        text = str(refusal).replace("{", "{{").replace("}", "}}")
        self.release_peer(
            channel, refusal.code, f"decode peer {{}}: session closed after a bad frame: {text}"
        )

    def release_peer(self, channel: Channel, reason: Reason, text: str) -> None:
        """Forget a decode peer's session: the rooms that still owe it bytes (or its
        confirmation) fail with ``text`` (``{}``: the peer), and its link closes once their
        writes stopped. A room whose target on it is settled goes on: a decode rank that
        leaves after its part of a room is done (its worker finished and exited) takes
        nothing from the other decode ranks' parts."""
        peer = self.peers.pop(id(channel), None)
        channel.close()
        text = text.format(peer.rank_id if peer else channel.label)
        fails = [
            self.ctx.spawn(self.fail_room(room, reason, text), room=room.room)
            for room in self.ctx.rooms.live()
            if isinstance(room, PrefillRoom) and _still_needs(room, channel)
        ]
        if peer is not None and peer.link is not None:
            link, peer.link = peer.link, None
            self.ctx.spawn(self._close_link(link, fails, peer), peer=peer.rank_id)

    async def _close_link(self, link: Link, fails: list[asyncio.Task[Any]], peer: DecodePeer) -> None:
        await asyncio.gather(*fails, return_exceptions=True)
        if peer.bells is not None:  # no write of its rooms is left to ring
            bells, peer.bells = peer.bells, None
            bells.close()
        await self.ctx.dataplane.release(link)


def _still_needs(room: PrefillRoom, channel: Channel) -> bool:
    """Whether ``room`` still needs something of the decode rank on ``channel``: bytes
    to write to it, or its confirmation of bytes written. A target this rank writes
    nothing to needs nothing (it ends with the room's last chunk)."""
    target = room.targets.get(id(channel))
    return target is not None and target.writes and not target.settled
