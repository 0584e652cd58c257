"""The sidecar's data plane: maps regions and picks a transport per peer pair.

At worker registration the sidecar maps its own worker's regions (shared
memory segments, or CUDA IPC handles on a GPU). A decode sidecar also starts
a tcp receiver for peers on other hosts. When prefill accepts a decode peer it
picks the transport for the pair: ``shm`` when both sidecars are on the same
host (equal ``host_id``) and the peer published its region handles, ``tcp``
otherwise or when configured. Device (CUDA) regions are copied with torch on
the device.

Every remote offset and length is bounds-checked against the registered
region sizes before a byte moves (by the copy engines, and for tcp again by
the receiver).
"""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from pd_transfer import cuda_ipc
from pd_transfer.agent.auth import security_of
from pd_transfer.config import SidecarConfig
from pd_transfer.errors import PdTransferError, Reason, TransportError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.protocol import Register
from pd_transfer.shm import Segment, open_segment
from pd_transfer.transport.base import Link, PeerEndpoint
from pd_transfer.transport.device_copy import execute_on_device
from pd_transfer.transport.shm import ShmTransport
from pd_transfer.transport.tcp import TcpTransport
from pd_transfer.transport.tcp_receiver import TcpReceiver

log = logging.getLogger(__name__)

class DeviceLink:
    """Same-host link to CUDA regions opened from the peer's IPC handles."""

    def __init__(self, peer_id: str, regions: dict) -> None:
        self.peer_id = peer_id
        self.regions = regions

    async def close(self) -> None:
        self.regions.clear()


class DataPlane:
    def __init__(self, config: SidecarConfig, context: zmq.asyncio.Context) -> None:
        self.config = config
        self.context = context
        self.local_regions: dict = {}
        self.on_device = False
        self._segments: list[Segment] = []
        self._shm = ShmTransport()
        security = security_of(context)
        # CURVE (when configured) covers the data sockets too, not only control
        self._tcp = TcpTransport(context, window_nbytes=config.max_inflight_nbytes,
                                 socket_options=security.curve_client)
        self._receiver: TcpReceiver | None = None
        self._device_links: list[DeviceLink] = []

    def transport_names(self) -> tuple[str, ...]:
        return ("shm", "tcp")

    # -- local regions ----------------------------------------------------------------
    async def map_local(self, geometry: RankGeometry, handles: dict[str, str]) -> None:
        """Map the worker's regions (refusing any smaller than what it registered)."""
        regions, segments = {}, []
        try:
            for region in geometry.regions:
                handle = handles[region.id]
                if cuda_ipc.is_cuda_handle(handle):
                    regions[region.id] = cuda_ipc.open_handle(handle, region.nbytes)[: region.nbytes]
                    self.on_device = True
                else:
                    segment = open_segment(handle, region.nbytes)
                    segments.append(segment)
                    regions[region.id] = segment.tensor[: region.nbytes]
        except PdTransferError:
            for segment in segments:
                segment.close()
            raise
        self._segments, self.local_regions = segments, regions
        if geometry.role is Role.DECODE and self.config.transport in ("auto", "tcp") \
                and not self.on_device:
            self._receiver = TcpReceiver(self.config.data_host, self.local_regions,
                                         port=self.config.data_port, context=self.context,
                                         socket_options=security_of(self.context).listening)
            await self._receiver.start()

    async def fence(self, room: int, generation: int) -> None:
        """Refuse late tcp chunks of ``room`` up to ``generation`` (no-op without a receiver)."""
        if self._receiver is not None:
            await self._receiver.fence(str(room), generation)

    def receive_address(self) -> str:
        return self._receiver.address if self._receiver is not None else ""

    # -- links ----------------------------------------------------------------------
    async def connect(self, register: Register) -> Link | DeviceLink:
        handles = {h.region: h.handle for h in register.region_handles}
        same_host = register.host_id == self.config.host_id and bool(handles)
        wanted = self.config.transport
        use_shm = wanted == "shm" or (wanted == "auto" and same_host)
        if use_shm and not same_host:
            raise PdTransferError(
                f"transport shm needs the decode peer on this host with published region handles "
                f"(peer host {register.host_id!r}, this host {self.config.host_id!r})",
                code=Reason.TRANSPORT_FAILED, hint="use --transport tcp or auto across hosts")
        sizes = {r.id: r.nbytes for r in register.geometry.regions}
        peer_id = register.geometry.rank_id
        try:
            if use_shm and any(cuda_ipc.is_cuda_handle(h) for h in handles.values()):
                regions = {r: cuda_ipc.open_handle(handles[r], n)[:n] for r, n in sizes.items()}
                link = DeviceLink(peer_id, regions)
                self._device_links.append(link)
                return link
            if use_shm:
                return await self._shm.connect(PeerEndpoint.from_maps(peer_id, sizes, handles))
            return await self._tcp.connect(PeerEndpoint.from_maps(peer_id, sizes, None,
                                                                  register.data_address))
        except TransportError as err:
            raise PdTransferError(f"cannot reach {peer_id}: {err.message}",
                                  code=Reason.TRANSPORT_FAILED, hint=err.hint) from None

    async def write(self, link, plan, room: int, generation: int) -> int:
        """Move every byte of ``plan``; returns only when all of it landed."""
        try:
            if isinstance(link, DeviceLink) or self.on_device:
                dst = link.regions if isinstance(link, DeviceLink) else None
                if dst is None:
                    raise PdTransferError("device regions need a same-host peer with CUDA handles",
                                          code=Reason.TRANSPORT_FAILED)
                return await asyncio.to_thread(execute_on_device, plan, self.local_regions, dst)
            transport = link.transport
            return await transport.write(link, plan, self.local_regions, room=str(room),
                                         generation=generation)
        except TransportError as err:
            raise PdTransferError(err.message, code=err.code, hint=err.hint) from None

    async def close(self) -> None:
        await self._shm.close()
        await self._tcp.close()
        for link in self._device_links:
            await link.close()
        if self._receiver is not None:
            await self._receiver.stop()
        for segment in self._segments:
            segment.close()
        self.local_regions = {}
