"""Same host, device memory: the peer's regions opened as torch tensors, copied with torch.

A decode worker whose pools are CUDA memory publishes a CUDA IPC handle per
region (:mod:`pd_transfer.memory.cuda_ipc`) where a host worker publishes a shared
memory segment name. :meth:`DeviceTransport.connect` opens those handles
(``open_region(handle, nbytes)``, in a thread: the first one initializes
CUDA) and :meth:`DeviceTransport.write` runs each plan with
:func:`~pd_transfer.transport.copy.device.execute_on_device`, which
bounds-checks every run against both sides before a byte moves and
synchronizes the devices it wrote to before it returns, so "returned" means
"landed". The source regions may be device tensors or host memory (numpy
arrays, viewed as tensors).

Nothing runs on the receiving side (as for shm): the writer writes in place,
so an abort is fenced by the writer draining (:meth:`Link.drain`).

``open_region`` defaults to :func:`pd_transfer.memory.cuda_ipc.open_handle`; tests
pass one that returns CPU tensors, which the same copies move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind
from pd_transfer.transport.copy.device import execute_on_device
from pd_transfer.transport.regions import Regions

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan

RegionOpener = Callable[[str, int], Any]  # (handle, nbytes) -> a tensor of at least nbytes bytes


class DeviceLink(Link):
    """A peer's regions opened as tensors (``regions``: region id -> uint8 tensor)."""

    in_place = True

    def __init__(self, transport: Transport, peer: PeerEndpoint, regions: dict) -> None:
        super().__init__(transport, peer)
        self.regions = regions

    async def _release(self) -> None:
        self.regions.clear()


def _open_cuda(handle: str, nbytes: int) -> Any:
    from pd_transfer.memory import cuda_ipc

    return cuda_ipc.open_handle(handle, nbytes)


class DeviceTransport(Transport):
    kind = TransportKind.DEVICE

    def __init__(self, open_region: RegionOpener = _open_cuda) -> None:
        super().__init__()
        self._open_region = open_region

    async def connect(self, peer: PeerEndpoint) -> DeviceLink:
        """Open every region of ``peer`` from its handle (``PeerRegion.segment``); an
        opener's error (a handle that is not one, a device gone) propagates as it is."""
        regions = await asyncio.to_thread(
            lambda: {r.region_id: self._open_region(r.segment, r.nbytes)[: r.nbytes] for r in peer.regions}
        )
        return self._adopt(DeviceLink(self, peer, regions))

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, DeviceLink)
        nbytes = await link.run_background(
            asyncio.to_thread(execute_on_device, plan, dict(src_regions), link.regions)
        )
        link.nbytes_written += nbytes
        link.num_writes += 1
        return nbytes
