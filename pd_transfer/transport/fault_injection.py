"""Test-only fault injection for the real data planes: a :class:`Transport` wrapping another.

A sidecar configured with ``fault_corrupt_nth = N`` (TEST ONLY, for the
integrity tests) wraps its shm and tcp transports in
:class:`CorruptingTransport`, all sharing one :class:`CorruptNth` count of the
sidecar's data writes. The Nth write lands with one byte flipped, once::

    fault = CorruptNth(3)
    transport = CorruptingTransport(ShmTransport(), fault)   # or around a TcpTransport
    link = await transport.connect(peer)                     # the wrapped transport's link
    await transport.write(link, plan, regions, room=7, generation=0)

The wrapper writes the plan through the transport it wraps, then, on the
Nth write, writes one more byte through it: the byte in the middle of the
plan's stream, read from the source and inverted, over the byte just landed
in the destination. So the damage takes the transport's own path (shared
memory written in place, a tcp chunk admitted by the decode receiver into
the room's pages), the source is never touched, and no transport carries a
test hook on its hot path: a sidecar without the setting never builds one.
The flipped byte lands after the write's aux row (as a byte going bad after
landing would): the fault breaks invariant (a) of :mod:`~pd_transfer.transport.base`
on purpose, once; until it is due the wrapper adds nothing to what it wraps.
"""

from __future__ import annotations

import numpy as np

from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport
from pd_transfer.transport.mock import stream_byte
from pd_transfer.transport.regions import Mapped, Regions

#: the source region of the one-byte write that flips a landed byte
FLIP_REGION = "fault.corrupt_nth"


class CorruptNth:
    """The count of a sidecar's data writes; :meth:`due` is true at the ``nth``, once."""

    def __init__(self, nth: int) -> None:
        self.nth = nth
        self.count = 0

    def due(self) -> bool:
        self.count += 1
        return self.count == self.nth


class CorruptingTransport(Transport):
    """``inner`` with the :class:`CorruptNth` fault: links are ``inner``'s own."""

    def __init__(self, inner: Transport, fault: CorruptNth) -> None:
        super().__init__()
        self.inner = inner
        self.kind = inner.kind
        self.fault = fault

    async def connect(self, peer: PeerEndpoint) -> Link:
        return await self.inner.connect(peer)

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        nbytes = await self.inner.write(link, plan, src_regions, room=room, generation=generation)
        if nbytes and self.fault.due():
            flip = flip_plan(plan, src_regions, nbytes // 2)
            if flip is not None:
                await self.inner.write(link, flip[0], flip[1], room=room, generation=generation)
        return nbytes

    async def close(self) -> None:
        await self.inner.close()

    def forget_sources(self) -> None:
        self.inner.forget_sources()


def flip_plan(
    plan: TransferPlan, src_regions: Regions, byte_index: int
) -> tuple[TransferPlan, Regions] | None:
    """A one-byte plan (and its source) that writes the inverse of the byte that byte
    ``byte_index`` of ``plan``'s stream carried, where that byte landed; None for a plan
    of no bytes."""
    found = stream_byte(plan, byte_index)
    if found is None:
        return None
    batch, src_offset, dst_offset = found
    memory = src_regions[batch.src_region]
    source = memory.array if isinstance(memory, Mapped) else memory
    value = int(source[src_offset])  # numpy or a torch tensor, any device
    one = RunBatch(
        FLIP_REGION,
        batch.dst_region,
        np.zeros(1, np.int64),
        np.array([dst_offset], np.int64),
        np.ones(1, np.int64),
        np.ones(1, np.int64),
        0,
        0,
    )
    flipped = np.array([value ^ 0xFF], np.uint8)
    return TransferPlan(plan.src_rank, plan.dst_rank, (one,)), {FLIP_REGION: flipped}
