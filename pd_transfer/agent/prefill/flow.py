"""Flow control on the prefill side: which writes may start, and what they hold.

The role logic (:mod:`~pd_transfer.agent.prefill.side`) asks here before it writes a chunk to a
decode peer. A room's first write to a peer waits for a slot under
``max_rooms_per_peer`` (held until the room ends); every chunk write waits
for its bytes under ``max_inflight_nbytes`` (that peer) and
``max_inflight_nbytes_total`` (all peers), held until the write returned.
The waiting itself, fair and bounded, is :mod:`pd_transfer.agent.admission`'s;
this module adds the peer key, the in-flight gauge, and the refusal of a
room a decode peer's request would add beyond ``max_rooms``.

A peer's key is its session's label (``decode[pp0,tp0] (agent-id)``): two
decode instances may both have a ``decode[pp0,tp0]``, and each gets its own
budget.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.protocol import Done, DoneStatus

if TYPE_CHECKING:
    from pd_transfer.agent.admission import Admission
    from pd_transfer.agent.channels import Channel
    from pd_transfer.agent.dataplane import DataPlane
    from pd_transfer.agent.observe import Observer
    from pd_transfer.agent.prefill.records import PrefillRoom, Target
    from pd_transfer.agent.rooms import RoomTable
    from pd_transfer.layout.lowering import TransferPlan
    from pd_transfer.protocol import Progress, TransferRequest


class FlowPlane(Protocol):
    """What a write uses of the sidecar: admission, the data plane, the in-flight gauge."""

    @property
    def admission(self) -> Admission: ...

    @property
    def dataplane(self) -> DataPlane: ...

    @property
    def observe(self) -> Observer: ...


@dataclass
class ChunkWrites:
    """What writing a chunk to a target takes: the sidecar's :class:`FlowPlane`, the room's
    transfer deadline, and how a Progress reaches the target's decode peer."""

    plane: FlowPlane
    transfer_timeout_s: float
    progress: Callable[[Target, Progress], Awaitable[None]]


def peer_key(target: Target) -> str:
    return target.peer.channel.label


async def admit_target(admission: Admission, room: PrefillRoom, target: Target) -> None:
    """Hold a room slot with the target's peer (once per target, until the room ends)."""
    if not target.admitted:
        await admission.admit_room(peer_key(target), room)
        target.admitted = True


async def write_chunk(plane: FlowPlane, room: PrefillRoom, target: Target, plan: TransferPlan) -> int:
    """Write ``plan`` to the target once its bytes are admitted; returns the bytes written."""
    await admit_target(plane.admission, room, target)
    grant = await plane.admission.admit_nbytes(peer_key(target), room, plan.total_nbytes)
    if room.terminal:  # it ended while this write was queued: nothing more may land
        grant.release()
        raise PdTransferError(f"room {room.room} ended before its write started", code=Reason.ABORTED)
    gauge = plane.observe.inflight(target.peer.rank_id)
    gauge.inc(plan.total_nbytes)
    try:
        return await plane.dataplane.write(target.peer.data_link, plan, room.room, target.generation)
    finally:
        gauge.dec(plan.total_nbytes)
        grant.release()


async def refuse_new_room(
    rooms: RoomTable[PrefillRoom],
    observe: Observer,
    agent_id: str,
    channel: Channel,
    message: TransferRequest,
) -> bool:
    """A decode peer's TransferRequest creates a room here: over ``max_rooms`` it is
    answered with a failed Done instead (True), like the worker's own send."""
    refusal = rooms.refusal(message.room)
    if refusal:
        observe.limit_refused("max_rooms")
        await channel.send(
            Done(
                room=message.room,
                generation=message.generation,
                status=DoneStatus.FAILED,
                reason=Reason.TOO_MANY_ROOMS,
                reason_text=f"prefill {agent_id}: {refusal}",
            )
        )
    return bool(refusal)
