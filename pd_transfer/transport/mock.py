"""An in-process transport for tests, with scripted faults. Ships in the package.

Destination regions are registered with the transport by peer id
(:meth:`MockTransport.register_peer`); writes run the real copy engine into
them, so bounds checks and byte placement are the production ones. Faults are
scripted per write::

    transport = MockTransport({"decode-0": decode_regions}, faults=[
        Fault.fail(on_write=2, reason=Reason.PEER_LOST),   # 2nd write raises, writes nothing
        Fault.partial(on_write=3, prefix_nbytes=4096),     # 3rd lands 4 KiB, then raises
        Fault.corrupt(on_write=4, byte_index=10),          # 4th "succeeds" with a flipped byte
        Fault.delay(on_write=5, delay_s=0.2),
        Fault.drop(on_write=6),                            # never returns: the caller times out
    ])

``on_write`` counts writes through this transport (1-based), or only the
writes to ``peer_id`` when a fault names one. :attr:`MockTransport.writes`
records every write and the faults applied to it.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind
from pd_transfer.transport.copy.copy_engine import CopyEngine, default_engine
from pd_transfer.transport.copy.runs import expand, flatten
from pd_transfer.transport.regions import Regions, map_one


class FaultKind(enum.Enum):
    FAIL = "fail"  # raise before a byte moves
    DELAY = "delay"  # sleep, then write normally
    DROP = "drop"  # never complete; nothing is written
    CORRUPT = "corrupt"  # write everything, flip one byte, report success
    PARTIAL = "partial"  # write a prefix of the byte stream, then raise


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    on_write: int = 1
    peer_id: str = ""
    reason: Reason = Reason.TRANSPORT_FAILED
    delay_s: float = 0.0
    prefix_nbytes: int = 0
    byte_index: int = 0

    @classmethod
    def fail(cls, on_write: int = 1, reason: Reason = Reason.TRANSPORT_FAILED, peer_id: str = "") -> Fault:
        return cls(FaultKind.FAIL, on_write, peer_id, reason)

    @classmethod
    def delay(cls, on_write: int = 1, delay_s: float = 0.1, peer_id: str = "") -> Fault:
        return cls(FaultKind.DELAY, on_write, peer_id, delay_s=delay_s)

    @classmethod
    def drop(cls, on_write: int = 1, peer_id: str = "") -> Fault:
        return cls(FaultKind.DROP, on_write, peer_id)

    @classmethod
    def corrupt(cls, on_write: int = 1, byte_index: int = 0, peer_id: str = "") -> Fault:
        return cls(FaultKind.CORRUPT, on_write, peer_id, byte_index=byte_index)

    @classmethod
    def partial(
        cls,
        on_write: int = 1,
        prefix_nbytes: int = 0,
        reason: Reason = Reason.TRANSPORT_FAILED,
        peer_id: str = "",
    ) -> Fault:
        return cls(FaultKind.PARTIAL, on_write, peer_id, reason, prefix_nbytes=prefix_nbytes)


@dataclass(frozen=True)
class WriteRecord:
    peer_id: str
    room: RoomId
    generation: int
    nbytes: int  # bytes that landed
    faults: tuple[FaultKind, ...]


class MockLink(Link):
    def __init__(self, transport: Transport, peer: PeerEndpoint, regions: Regions) -> None:
        super().__init__(transport, peer)
        self.regions = regions

    async def _release(self) -> None:
        self.regions = {}


class MockTransport(Transport):
    kind = TransportKind.MOCK

    def __init__(
        self,
        peers: Mapping[str, Regions] | None = None,
        faults: Iterable[Fault] = (),
        engine: CopyEngine | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine or default_engine()
        self._peers: dict[str, Regions] = dict(peers or {})
        self._faults: list[Fault] = list(faults)
        self._count = 0
        self._count_by_peer: dict[str, int] = {}
        self.writes: list[WriteRecord] = []

    def register_peer(self, peer_id: str, regions: Regions) -> None:
        self._peers[peer_id] = regions

    def script(self, *faults: Fault) -> None:
        self._faults.extend(faults)

    async def connect(self, peer: PeerEndpoint) -> MockLink:
        regions = self._peers.get(peer.peer_id)
        if regions is None:
            raise TransportError(
                f"mock transport: no regions registered for peer {peer.peer_id}", code=Reason.NOT_REGISTERED
            )
        for handle in peer.regions:  # the endpoint must describe what is really there
            if handle.region_id not in regions:
                raise TransportError(
                    f"peer {peer.peer_id} region {handle.region_id!r} is not registered with the mock",
                    code=Reason.UNKNOWN_REGION,
                )
            size = map_one(handle.region_id, regions[handle.region_id], "destination").nbytes
            if size < handle.nbytes:
                raise TransportError(
                    f"peer {peer.peer_id} region {handle.region_id!r} holds "
                    f"{size} bytes, endpoint says {handle.nbytes}",
                    code=Reason.SEGMENT_TOO_SMALL,
                )
        return self._adopt(MockLink(self, peer, regions))

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, MockLink)
        peer_id = link.peer.peer_id
        self._count += 1
        self._count_by_peer[peer_id] = self._count_by_peer.get(peer_id, 0) + 1
        faults = [
            f
            for f in self._faults
            if f.on_write == (self._count_by_peer[peer_id] if f.peer_id else self._count)
            and f.peer_id in ("", peer_id)
        ]
        kinds = tuple(f.kind for f in faults)
        src_regions = self._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
        landed = 0
        try:
            if FaultKind.DROP in kinds:  # nothing will ever land: not background work to drain
                await asyncio.Event().wait()
            # a delayed write whose caller gives up still lands later, as a slow peer's would
            landed = await link.run_background(self._apply(link, plan, src_regions, faults))
        finally:
            self.writes.append(WriteRecord(peer_id, room, generation, landed, kinds))
        link.nbytes_written += landed
        link.num_writes += 1
        return landed

    async def _apply(self, link: MockLink, plan, src_regions: Regions, faults: list[Fault]) -> int:
        where = f"mock write {plan.src_rank} -> {link.peer.peer_id}"
        for fault in faults:
            if fault.kind is FaultKind.DELAY:
                await asyncio.sleep(fault.delay_s)
        for fault in faults:
            if fault.kind is FaultKind.FAIL:
                raise TransportError(f"{where}: scripted failure", code=fault.reason)
            if fault.kind is FaultKind.PARTIAL:
                prefix = truncate_plan(plan, fault.prefix_nbytes)
                await asyncio.to_thread(self.engine.execute, prefix, src_regions, link.regions)
                raise TransportError(
                    f"{where}: scripted failure after {prefix.total_nbytes} of {plan.total_nbytes} bytes",
                    code=fault.reason,
                )
        nbytes = await asyncio.to_thread(self.engine.execute, plan, src_regions, link.regions, where=where)
        for fault in faults:
            if fault.kind is FaultKind.CORRUPT:
                flip_byte(plan, link.regions, fault.byte_index)
        return nbytes


def truncate_plan(plan, prefix_nbytes: int) -> TransferPlan:
    """The first ``prefix_nbytes`` of ``plan``'s byte stream (runs in plan order) as a plan."""
    flat = flatten(plan)
    runs = expand(flat)
    end = np.cumsum(runs.nbytes)
    keep = int(np.searchsorted(end, prefix_nbytes, side="left"))
    nbytes = runs.nbytes[: keep + 1].copy()
    if keep < len(runs):
        nbytes[-1] -= int(end[keep]) - prefix_nbytes  # cut the run the prefix ends in
    batch = runs.batch[: keep + 1]
    batches = []
    for b in np.unique(batch).tolist():
        mine = (batch == b) & (nbytes > 0)
        source = flat.batches[b]
        batches.append(
            RunBatch(
                source.src_region,
                source.dst_region,
                runs.src_offset[: keep + 1][mine],
                runs.dst_offset[: keep + 1][mine],
                nbytes[mine],
                np.ones(int(mine.sum()), np.int64),
                0,
                0,
            )
        )
    return TransferPlan(plan.src_rank, plan.dst_rank, tuple(batches))


def stream_byte(plan: TransferPlan, byte_index: int) -> tuple[RunBatch, int, int] | None:
    """Where byte ``byte_index`` of ``plan``'s stream (clamped into it) comes from and lands:
    its batch, source offset and destination offset; None for a plan of no bytes."""
    flat = flatten(plan)
    runs = expand(flat)
    if not len(runs):
        return None
    end = np.cumsum(runs.nbytes)
    index = min(max(byte_index, 0), int(end[-1]) - 1)
    i = int(np.searchsorted(end, index, side="right"))
    into = index - (int(end[i]) - int(runs.nbytes[i]))
    return flat.batches[int(runs.batch[i])], int(runs.src_offset[i]) + into, int(runs.dst_offset[i]) + into


def flip_byte(plan: TransferPlan, dst_regions: Regions, byte_index: int) -> None:
    """XOR 0xFF into the destination byte that byte ``byte_index`` of the stream landed on."""
    found = stream_byte(plan, byte_index)
    if found is None:
        return
    batch, _, offset = found
    array = map_one(batch.dst_region, dst_regions[batch.dst_region], "destination").array
    array[offset] ^= 0xFF
