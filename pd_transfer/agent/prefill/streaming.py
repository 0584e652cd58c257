"""Layer-wise streaming on the prefill side: which layers of a chunk may move now.

A prefill worker may hand a chunk over before its forward pass has written
the KV (``send(..., stream=True)``) and then announce each layer as it is
computed (``layer_ready(room, layer_id)``). The sidecar moves a streamed
chunk's KV one batch of ready layers at a time, so the transfer overlaps
compute; what is left when the last layer is announced is one layer's
bytes, not the whole request's.

Rules, per streamed chunk:

- the layers to announce are every layer id of this rank's span (from its
  registered geometry, attention or not); any order; repeats are harmless;
- KV moves per announced layer; SWA pages, Mamba/linear-attention state and
  the aux row (which go with the last chunk) move only once every layer of
  that chunk is announced, aux last as always;
- ``layer_ready`` names the room's latest chunk, which must be streamed; an
  id outside the span, or a room whose latest chunk is not streamed, is
  refused with a reason (never silently ignored: a lost announcement would
  hang the room until its deadline).

Decode's Success is unchanged: the Done goes out after the final write.
The bookkeeping is pure (a chunk's announced layers, :mod:`.layers`);
:func:`chunk_plan` is the one step that writes (a streamed chunk's ready
layers, through the admitted writes of :mod:`.flow`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pd_transfer.agent.prefill.chunks import ChunkRequests
from pd_transfer.agent.prefill.flow import ChunkWrites, write_chunk
from pd_transfer.agent.prefill.layers import ChunkLayers
from pd_transfer.layout.views import Pool
from pd_transfer.protocol import Progress, RoomStatus

if TYPE_CHECKING:
    from pd_transfer.agent.prefill.records import PrefillRoom, Target
    from pd_transfer.layout.lowering import TransferPlan


async def write_ready_layers(
    writes: ChunkWrites, room: PrefillRoom, target: Target, requests: ChunkRequests, layers: ChunkLayers
) -> bool:
    """Write the chunk's KV of every announced layer not yet sent to ``target``.

    Loops while layers keep arriving during the writes; a Progress after each
    batch keeps decode's deadline moving. Returns True once every layer of the
    chunk is announced and sent (the caller then writes the chunk's final
    pools), False while some are still to come.
    """
    while pending := layers.pending(target.layers_sent):
        if Pool.KV in requests:
            plan = target.peer.pair_planner.plan({Pool.KV: requests[Pool.KV]}, layers=pending)
            room.advance(RoomStatus.TRANSFERRING, time.monotonic() + writes.transfer_timeout_s)
            nbytes = await write_chunk(writes.plane, room, target, plan)
            target.nbytes += nbytes
            target.descriptors += plan.num_descriptors
            room.nbytes += nbytes
            await writes.progress(
                target,
                Progress(
                    room=room.room,
                    generation=target.generation,
                    done_nbytes=room.nbytes,
                    total_nbytes=room.nbytes,
                ),
            )
        target.layers_sent.update(pending)
        if room.terminal or target.failed:
            return False
    return layers.complete


async def chunk_plan(
    writes: ChunkWrites, room: PrefillRoom, target: Target, index: int, requests: ChunkRequests
) -> TransferPlan | None:
    """What is left to write of chunk ``index`` for ``target`` (None: wait for layers).

    A chunk that is not streamed: its whole plan. A streamed one: its ready
    layers are written here first; once every layer is sent, the plan of its
    other pools (SWA pages, state, aux; possibly empty).
    """
    layers = room.layers[index]
    if layers is None:
        # a link that copies small plans as grids (shm, native loop) gets them unlowered
        return target.peer.pair_planner.plan(requests, grid_max_runs=target.peer.data_link.grid_max_runs)
    if not await write_ready_layers(writes, room, target, requests, layers):
        return None
    return target.peer.pair_planner.plan({p: r for p, r in requests.items() if p is not Pool.KV})
