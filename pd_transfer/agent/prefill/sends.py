"""The prefill worker's room operations: ``send`` (a chunk of a room) and ``layer_ready``.

A send is checked against this rank's own pools before a byte moves (a bad one
fails the room at once, so decode learns it too), binds the room to its decode
instance (:mod:`.ownership`), and hands the chunk to the pumps
(:mod:`.writes`), which start writing before the reply goes. ``layer_ready``
announces a layer of the room's latest streamed chunk (:mod:`.layers`).
A room is opened by whichever comes first, the worker's send or a decode
rank's TransferRequest (:func:`open_room`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pd_transfer.agent.indices import check_indices
from pd_transfer.agent.prefill import ownership
from pd_transfer.agent.prefill.chunks import chunk_refusal
from pd_transfer.agent.prefill.layers import ChunkLayers, latest_streamed, span_of
from pd_transfer.agent.prefill.records import PrefillRoom
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.views import Pool

if TYPE_CHECKING:
    from pd_transfer.agent.prefill.endings import PrefillEndings
    from pd_transfer.agent.prefill.ownership import OnRequest
    from pd_transfer.agent.prefill.writes import PrefillWrites
    from pd_transfer.agent.side_context import SideContext
    from pd_transfer.protocol.worker_requests import LayerReadyRequest, SendRequest


def open_room(ctx: SideContext[PrefillRoom], room_id: int) -> PrefillRoom:
    """The live room ``room_id``, opened (with its bootstrap deadline) if there is none,
    or only a finished one that nothing of this side still holds."""
    room = ctx.rooms.get(room_id)
    if room is None or (room.terminal and not room.targets and not room.chunks and not room.refused):
        room = PrefillRoom(room_id, 0)
        room.deadline_s = time.monotonic() + ctx.config.bootstrap_timeout_s
        ctx.rooms.add(room)
    return room


class PrefillSends:
    """The worker's sends and layer announcements (a collaborator of
    :class:`~pd_transfer.agent.prefill.side.PrefillSide`)."""

    def __init__(
        self, ctx: SideContext[PrefillRoom], endings: PrefillEndings, pumps: PrefillWrites, request: OnRequest
    ) -> None:
        self.ctx = ctx
        self.endings = endings
        self.pumps = pumps
        self.request = request  # the side's on_request: admits a bound room's contenders

    async def on_send(self, request: SendRequest, pools: dict[Pool, np.ndarray]) -> dict[str, Any]:
        ctx, config = self.ctx, self.ctx.config
        try:  # against this rank's own pools, before a byte moves
            check_indices(pools, ctx.registered().geometry, side="source", unique=False)
        except PdTransferError as err:
            # refused to the worker, and the room fails with it, so decode learns at once
            room = open_room(ctx, request.room)
            room.refused = True
            await self.endings.fail_room(room, err.code, f"room {room.room}: {err.message}")
            raise
        room = open_room(ctx, request.room)
        if room.last_received:
            raise PdTransferError(f"room {room.room}: send after the last chunk", code=Reason.DUPLICATE_ROOM)
        if room.terminal:
            return room.reply()
        await ownership.bind(room, request.decode, self.request)
        if chunk_refusal(config, room):
            ctx.observe.limit_refused("max_chunks_per_room")
            await self.endings.fail_room(room, Reason.OVER_LIMIT, chunk_refusal(config, room))
            return room.reply()
        room.chunks.append(pools)
        room.layers.append(ChunkLayers(span_of(ctx.registered().geometry)) if request.stream else None)
        room.last_received = request.last
        self.pumps.pump_all(room)
        # the writes start before the reply goes: a small room (copied on the loop) is
        # copied and rung first. Replying first woke the worker, which on a busy host
        # took the CPU from this loop for a few hundred microseconds mid-room. A large
        # room's copy leaves for its thread at once, and the reply follows.
        await asyncio.sleep(0)
        return room.reply()

    async def on_layer_ready(self, request: LayerReadyRequest) -> dict[str, Any]:
        room = self.ctx.rooms.get(request.room)
        if not isinstance(room, PrefillRoom):
            raise PdTransferError(f"room {request.room} is unknown", code=Reason.UNKNOWN_ROOM)
        if not room.terminal:
            latest_streamed(room.layers, room.room).announce(room.room, request.layer_id)
            self.pumps.pump_all(room)
        return room.reply()
