"""Writing a prefill room to its targets: one pump per decode rank it feeds.

A pump writes what its target can take now, chunk by chunk, as soon as both
the worker's chunk and decode's request are there (streamed chunks one batch
of ready layers at a time, :mod:`.streaming`), each write admitted by
:mod:`.flow`. After each chunk but the last a Progress keeps decode's
deadline moving; the last chunk carries state slots, SWA pages and the aux
row (written last: its arrival means everything before it landed), then the
target's doorbell rings and a Done goes out. Anything that escapes a write (a
bug) still ends the room at once, with what it was, never at its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pd_transfer.agent import integrity
from pd_transfer.agent.dataplane import SegmentTruncated
from pd_transfer.agent.prefill.chunks import chunk_requests
from pd_transfer.agent.prefill.endings import PrefillEndings
from pd_transfer.agent.prefill.flow import ChunkWrites, write_chunk
from pd_transfer.agent.prefill.records import PrefillRoom, Target, TargetState
from pd_transfer.agent.prefill.streaming import chunk_plan
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Close, Done, DoneStatus, Progress, RoomStatus

if TYPE_CHECKING:
    from pd_transfer.agent.side_context import SideContext

log = logging.getLogger(__package__)


class PrefillWrites:
    """The prefill side's pumps (a collaborator of
    :class:`~pd_transfer.agent.prefill.side.PrefillSide`); a room they cannot write
    ends through ``endings``."""

    def __init__(self, ctx: SideContext[PrefillRoom], endings: PrefillEndings) -> None:
        self.ctx = ctx
        self.endings = endings
        self.writes = ChunkWrites(ctx, ctx.config.transfer_timeout_s, endings.send_quietly)

    def pump_all(self, room: PrefillRoom) -> None:
        for target in list(room.targets.values()):
            self.ctx.spawn(self._pump(room, target), room=room.room)

    async def _pump(self, room: PrefillRoom, target: Target) -> None:
        """Write what ``target`` can take now; anything that escapes (a bug) still ends
        the room at once, with what it was, never at its timeout."""
        try:
            await self._pump_target(room, target)
        except Exception as err:
            await self._internal_error(room, target, err)

    async def _internal_error(
        self, room: PrefillRoom, target: Target, err: Exception, lock_held: Target | None = None
    ) -> None:
        """A bug escaped a write to ``target``: logged with its traceback, and the room
        fails now with what it was (unless the target's abort fails it), not at its timeout."""
        log.exception("prefill: room %s -> %s: internal error", room.room, target.peer.rank_id)
        if not target.failed:
            await self.endings.fail_room(
                room,
                Reason.TRANSPORT_FAILED,
                f"room {room.room} -> {target.peer.rank_id}: internal error in the prefill sidecar: {err!r}",
                lock_held=lock_held,
            )

    async def _pump_target(self, room: PrefillRoom, target: Target) -> None:
        async with target.lock:
            if not target.writes:
                if room.last_received and not target.done and not room.terminal:
                    target.end()
                    self.endings.maybe_succeed(room)
                return
            while target.chunks_done < len(room.chunks) and not target.failed and not room.terminal:
                if not await self._write_next_chunk(room, target):
                    return
            if (
                room.last_received
                and target.chunks_done == len(room.chunks)
                and not target.done
                and not target.failed
                and not room.terminal
            ):
                await self._succeed(room, target)

    async def _write_next_chunk(self, room: PrefillRoom, target: Target) -> bool:
        """Write chunk ``target.chunks_done`` to ``target``: False when the pump stops here
        (a streamed chunk waits for layers, or the write failed the room)."""
        index = target.chunks_done
        try:
            requests = chunk_requests(room, target, index)
            plan = await chunk_plan(self.writes, room, target, index, requests)
            if plan is None:
                return False  # streamed: the next layer_ready pumps again
            room.advance(RoomStatus.TRANSFERRING, time.monotonic() + self.ctx.config.transfer_timeout_s)
            nbytes = await write_chunk(self.writes.plane, room, target, plan)
            target.nbytes += nbytes
            target.descriptors += plan.num_descriptors
            await integrity.sum_chunk(target, requests, self.ctx.dataplane.local_regions)
        except SegmentTruncated as err:
            await self._on_truncated(room, target, err)
            return False
        except PdTransferError as err:
            if not target.failed:  # else the abort of this target fails the room itself
                text = f"room {room.room} -> {target.peer.rank_id}: {err.message}"
                await self.endings.fail_room(room, err.code, text, lock_held=target)
            return False
        except Exception as err:  # a bug here: fail the room now, not at its timeout
            await self._internal_error(room, target, err, lock_held=target)
            return False
        room.nbytes += nbytes
        target.kv_cursor += len(room.chunks[index].get(Pool.KV, ()))
        target.chunks_done, target.layers_sent = target.chunks_done + 1, set()
        if not (room.last_received and target.chunks_done == len(room.chunks)):
            await self.endings.send_quietly(
                target,
                Progress(
                    room=room.room,
                    generation=target.generation,
                    done_nbytes=room.nbytes,
                    total_nbytes=room.nbytes,
                ),
            )
        return True

    async def _succeed(self, room: PrefillRoom, target: Target) -> None:
        """Every byte of the room is written to ``target``: ring its doorbell, send Done."""
        target.state = TargetState.SUCCEEDED
        bells = target.peer.bells
        if target.bell is not None and bells is not None:
            # the worker learns it here, Done tells its sidecar
            self.ctx.observe.doorbell("rang" if bells.ring(*target.bell) else "stale")
            await asyncio.sleep(0)  # a send waiting on this copy replies before Done
        await self.endings.send_quietly(
            target,
            Done(
                room=room.room,
                generation=target.generation,
                status=DoneStatus.SUCCESS,
                checksums=integrity.checksums(target),
            ),
        )
        self.ctx.observe.transfer_done(
            target.peer.rank_id,
            target.nbytes,
            target.descriptors,
            time.monotonic() - target.started_s,
        )
        self.endings.maybe_succeed(room)

    async def _on_truncated(self, room: PrefillRoom, target: Target, err: SegmentTruncated) -> None:
        """A segment shrank under a write: the room fails with why; a decode peer that
        did it is dropped (its other rooms fail, its mapping goes), since what it left
        mapped is zeros, not its memory."""
        text = f"room {room.room} -> {target.peer.rank_id}: {err.message}"
        if not target.failed:
            await self.endings.fail_room(room, err.code, text, lock_held=target)
        if not err.local and self.endings.peers.get(id(target.peer.channel)) is target.peer:
            self.ctx.observe.lost(target.peer.rank_id, err.message, target.peer.channel, missed=False)
            try:  # it learns why at once, and maps afresh on its next room
                await target.peer.channel.send(Close(reason=err.code, reason_text=err.message[:4000]))
            except Exception as failure:
                log.debug("prefill: no Close to %s: %s", target.peer.rank_id, failure)
            why = err.message.replace("{", "{{").replace("}", "}}")
            self.endings.release_peer(target.peer.channel, err.code, f"decode peer {{}} dropped: {why}")
