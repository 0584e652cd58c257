"""Same-host transport: map the peer's shared-memory segments and copy into them.

The decode worker allocates its regions as POSIX shared-memory segments
(:mod:`pd_transfer.memory.segments`) and publishes one segment name per region. On
:meth:`ShmTransport.connect` the writer maps each (refusing a segment smaller
than the region the peer registered); :meth:`ShmTransport.write` then runs
the copy engine straight from its own regions into the mapped destination: no
intermediate buffer, no receiver process involved.

The engine bounds-checks every run against the mapped sizes first, so a plan
that disagrees with the peer's segments fails with RUN_OUT_OF_REGION and
writes nothing.

Source regions in device (CUDA) memory are copied by torch into the mapped
segments, viewed as host tensors (:func:`~pd_transfer.transport.copy.device.execute_on_device`,
which bounds-checks the same way): a GPU prefill worker writes to a decode
worker whose pools are shared memory through this same transport.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.grids import GridPlan
from pd_transfer.memory.segments import Segment, open_segment
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind
from pd_transfer.transport.copy.copy_engine import CopyEngine, default_engine
from pd_transfer.transport.copy.device import as_tensors, execute_on_device
from pd_transfer.transport.regions import Regions, map_one, on_device

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan


class ShmLink(Link):
    """The peer's segments, mapped; ``regions`` are numpy views of exactly the registered
    sizes, ``tensors`` the same as torch tensors (for torch's device copies; made on first
    use, so that a sidecar copying between host pools never loads torch)."""

    in_place = True

    def __init__(self, transport: ShmTransport, peer: PeerEndpoint, segments: dict[str, Segment]) -> None:
        super().__init__(transport, peer)
        self.segments = segments
        self.regions = {
            handle.region_id: segments[handle.region_id].array[: handle.nbytes] for handle in peer.regions
        }
        self.mapped = {
            region_id: map_one(region_id, array, "destination") for region_id, array in self.regions.items()
        }
        self._tensors: dict | None = None
        self.programs: dict = {}  # the copy engine's grid programs into these regions
        # rooms this small come as grid plans when the engine copies them natively
        self.grid_max_runs = transport.inline_max_runs if transport.engine.native else 0

    def mapped_segments(self) -> dict[str, Segment]:
        return self.segments

    def forget_sources(self) -> None:
        self.programs.clear()  # the grid programs hold source addresses

    @property
    def tensors(self) -> dict:
        """``regions`` as torch uint8 tensors on the same memory."""
        if self._tensors is None:
            self._tensors = as_tensors(self.regions)
        return self._tensors

    async def _release(self) -> None:
        self.regions, self.mapped, self.programs, self._tensors = {}, {}, {}, None
        for segment in self.segments.values():
            segment.close()  # never unlink: the peer owns its segments
        self.segments = {}


class ShmTransport(Transport):
    kind = TransportKind.SHM

    def __init__(self, engine: CopyEngine | None = None, *, inline_max_runs: int = 256) -> None:
        super().__init__()
        self.engine = engine or default_engine()
        self.inline_max_runs = inline_max_runs
        self._device_sources: tuple[Regions, bool] | None = None  # the last sources seen, and if on a device

    async def connect(self, peer: PeerEndpoint) -> ShmLink:
        """Map every region of ``peer``; raises if one has no segment or a short one."""
        missing = [h.region_id for h in peer.regions if not h.segment]
        if missing:
            raise TransportError(
                f"peer {peer.peer_id} offers no shared-memory segment for region(s) {missing[:5]}",
                code=Reason.TRANSPORT_UNSUPPORTED,
                hint="use the tcp transport for peers on another host",
            )
        segments = await asyncio.to_thread(_open_all, peer)
        return self._adopt(ShmLink(self, peer, segments))

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, ShmLink)
        if self._on_device(src_regions):  # torch copies from the device into the mapped segments
            nbytes = await link.run_background(
                asyncio.to_thread(execute_on_device, plan, dict(src_regions), link.tensors)
            )
            link.nbytes_written += nbytes
            link.num_writes += 1
            return nbytes
        where = f"room {room} gen {generation} plan {plan.src_rank} -> {link.peer.peer_id}"
        if plan.num_runs <= self.inline_max_runs:
            # a few pages (a 1-page Llama room is 64 runs, 2 MiB): copying on the loop
            # takes less time than the thread hop would; a grid plan needs no source
            # mapping here (the engine's grid programs keep the addresses, per link)
            src = (
                src_regions
                if isinstance(plan, GridPlan)
                else self._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
            )
            nbytes = self.engine.execute(plan, src, link.mapped, where=where, programs=link.programs)
        else:
            src = self._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
            # the copy cannot be interrupted once in its thread; run_background lets
            # a cancelled caller go while Link.drain still waits for the copy
            nbytes = await link.run_background(
                asyncio.to_thread(self.engine.execute, plan, src, link.mapped, where=where)
            )
        link.nbytes_written += nbytes
        link.num_writes += 1
        return nbytes

    def _on_device(self, src_regions: Regions) -> bool:
        """Whether a region of ``src_regions`` is device memory (looked at once per mapping:
        a sidecar passes the same one with every write)."""
        if self._device_sources is None or self._device_sources[0] is not src_regions:
            self._device_sources = (src_regions, any(on_device(m) for m in src_regions.values()))
        return self._device_sources[1]

    def forget_sources(self) -> None:
        super().forget_sources()
        self._device_sources = None


def _open_all(peer: PeerEndpoint) -> dict[str, Segment]:
    opened: dict[str, Segment] = {}
    try:
        for handle in peer.regions:
            try:
                opened[handle.region_id] = open_segment(handle.segment, min_nbytes=handle.nbytes)
            except TransportError as err:
                raise TransportError(
                    f"peer {peer.peer_id} region {handle.region_id!r}: {err.message}",
                    code=err.code,
                    hint=err.hint,
                ) from None
    except BaseException:
        for segment in opened.values():
            segment.close()
        raise
    return opened
