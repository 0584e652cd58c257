"""The test-only corruption fault as a wrapping transport (pd_transfer.transport.fault_injection).

Two identical scenarios (same seed): one moved by a plain transport, which the
oracle (``World.verify``) finds byte-exact; one moved through
:class:`CorruptingTransport` around the same kind of transport with the fault
due at the 2nd write. The two destinations differ in exactly one byte, the
inverse of the clean one, in the 2nd plan's destination rank; the sources are
untouched and the fault fires once.
"""

from __future__ import annotations

import numpy as np
import pytest

from pd_transfer.transport import PeerEndpoint, ShmTransport, TcpReceiver, TcpTransport
from pd_transfer.transport.base import Transport
from pd_transfer.transport.fault_injection import CorruptingTransport, CorruptNth

pytestmark = pytest.mark.asyncio
NTH = 2


async def _move(kind: str, sc, transport: Transport, segments) -> None:
    """Every plan of ``sc`` through ``transport`` into the scenario's decode buffers."""
    if kind == "shm":
        placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
        links = {
            rank: await transport.connect(
                PeerEndpoint.from_maps(
                    rank, {r: s.nbytes for r, s in segs.items()}, {r: s.name for r, s in segs.items()}
                )
            )
            for rank, segs in placed.items()
        }
        for room, plan in enumerate(sc.plans):
            assert (
                await transport.write(links[plan.dst_rank], plan, sc.src(plan), room=room)
                == plan.total_nbytes
            )
        await transport.close()
        for rank, segs in placed.items():
            for region_id, segment in segs.items():
                sc.world.decode_buffers[rank][region_id][:] = segment.array
        return
    receivers = {rank: TcpReceiver("127.0.0.1", regions) for rank, regions in sc.world.decode_buffers.items()}
    try:
        links = {}
        for rank, receiver in receivers.items():
            links[rank] = await transport.connect(PeerEndpoint(rank, data_address=await receiver.start()))
        for room, plan in enumerate(sc.plans):
            assert (
                await transport.write(links[plan.dst_rank], plan, sc.src(plan), room=room)
                == plan.total_nbytes
            )
        await transport.close()
    finally:
        for receiver in receivers.values():
            await receiver.stop()


def _plain(kind: str) -> Transport:
    return ShmTransport() if kind == "shm" else TcpTransport(chunk_nbytes=64 << 10)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
async def test_the_nth_write_lands_one_byte_inverted_and_only_that(kind, scenario, segments):
    clean, faulty = scenario("llama", 2, 4, seed=3), scenario("llama", 2, 4, seed=3)
    assert len(faulty.plans) > NTH
    await _move(kind, clean, _plain(kind), segments)
    assert clean.world.verify(clean.requests) == []

    sources = {
        rank: {r: a.copy() for r, a in regions.items()}
        for rank, regions in faulty.world.prefill_buffers.items()
    }
    fault = CorruptNth(NTH)
    wrapped = CorruptingTransport(_plain(kind), fault)
    assert wrapped.kind is wrapped.inner.kind and wrapped.name == kind
    await _move(kind, faulty, wrapped, segments)
    assert fault.count == len(faulty.plans)  # every write counted, the 2nd damaged

    assert faulty.world.verify(faulty.requests) != []
    differ = [
        (rank, region_id, int(i))
        for rank, regions in faulty.world.decode_buffers.items()
        for region_id, array in regions.items()
        for i in np.flatnonzero(array != clean.world.decode_buffers[rank][region_id])
    ]
    assert len(differ) == 1, differ
    rank, region_id, offset = differ[0]
    assert rank == faulty.plans[NTH - 1].dst_rank
    good = int(clean.world.decode_buffers[rank][region_id][offset])
    assert int(faulty.world.decode_buffers[rank][region_id][offset]) == good ^ 0xFF
    for rank, regions in faulty.world.prefill_buffers.items():  # the sources are untouched
        assert all(np.array_equal(array, sources[rank][r]) for r, array in regions.items())
