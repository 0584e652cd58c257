"""The sidecar's data plane: maps regions and picks a transport per peer pair.

At worker registration the sidecar maps its own worker's segments. When a
decode peer is accepted, prefill picks the transport for the pair: ``shm``
when both sidecars are on the same host (equal ``host_id``) and the peer
published segment handles, ``tcp`` otherwise (or when configured). Writes
run the copy engine in a worker thread, so the event loop keeps serving
heartbeats and other rooms while bytes move.

Every remote offset and length is bounds-checked against the registered
region sizes by the copy engine before a byte moves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq.asyncio

from pd_transfer.config import SidecarConfig
from pd_transfer.errors import PdTransferError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.protocol import Register
from pd_transfer.shm import Segment, open_segment

log = logging.getLogger(__name__)


@dataclass
class Link:
    """A prefill -> decode data path."""

    transport: str
    peer: str
    dst_regions: dict = field(default_factory=dict)   # shm: region id -> tensor
    segments: list[Segment] = field(default_factory=list)
    sender: object = None                              # tcp: the transport's link

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        self.segments.clear()
        self.dst_regions.clear()


class DataPlane:
    def __init__(self, config: SidecarConfig, context: zmq.asyncio.Context) -> None:
        self.config = config
        self.context = context
        self.local_regions: dict = {}
        self._local_segments: list[Segment] = []
        self._links: list[Link] = []
        self._tcp = None           # pd_transfer.transport.tcp objects, created lazily
        self._receiver = None

    def transport_names(self) -> tuple[str, ...]:
        return ("shm", "tcp")

    # -- local regions --------------------------------------------------------------
    def map_local(self, geometry: RankGeometry, handles: dict[str, str]) -> None:
        """Map the worker's segments (refusing any smaller than its registered region)."""
        segments = []
        try:
            for region in geometry.regions:
                segments.append(open_segment(handles[region.id], region.nbytes))
        except PdTransferError:
            for segment in segments:
                segment.close()
            raise
        self._local_segments = segments
        self.local_regions = {r.id: s.tensor[: r.nbytes] for r, s in zip(geometry.regions, segments)}
        if self.config.role.value == "decode" and self.config.transport in ("auto", "tcp"):
            self._start_receiver(geometry)

    def _start_receiver(self, geometry: RankGeometry) -> None:
        try:
            from pd_transfer.transport.tcp import TcpReceiver
        except ImportError:
            log.warning("tcp transport unavailable: decode accepts shm only")
            return
        self._receiver = TcpReceiver(self.config.data_host, self.local_regions, context=self.context)
        self._receiver.start()

    def receive_address(self) -> str:
        return self._receiver.address if self._receiver is not None else ""

    # -- links ----------------------------------------------------------------------
    async def connect(self, register: Register) -> Link:
        same_host = register.host_id == self.config.host_id and register.region_handles
        wanted = self.config.transport
        if wanted == "shm" or (wanted == "auto" and same_host):
            if not same_host:
                raise PdTransferError(
                    f"transport shm needs the decode peer on this host with published segments "
                    f"(peer host {register.host_id!r}, this host {self.config.host_id!r})",
                    code=Reason.TRANSPORT_FAILED)
            return self._link_shm(register)
        return await self._link_tcp(register)

    def _link_shm(self, register: Register) -> Link:
        link = Link("shm", register.geometry.rank_id)
        handles = {h.region: h.handle for h in register.region_handles}
        try:
            for region in register.geometry.regions:
                if region.id not in handles:
                    raise PdTransferError(f"decode peer published no segment for region {region.id}",
                                          code=Reason.TRANSPORT_FAILED)
                segment = open_segment(handles[region.id], region.nbytes)
                link.segments.append(segment)
                link.dst_regions[region.id] = segment.tensor[: region.nbytes]
        except PdTransferError:
            link.close()
            raise
        self._links.append(link)
        return link

    async def _link_tcp(self, register: Register) -> Link:
        if not register.data_address:
            raise PdTransferError("the decode peer offers no tcp data address",
                                  code=Reason.TRANSPORT_FAILED)
        from pd_transfer.transport.tcp import TcpSender
        sender = TcpSender(register.data_address, context=self.context,
                           max_inflight_nbytes=self.config.max_inflight_nbytes,
                           region_sizes={r.id: r.nbytes for r in register.geometry.regions})
        link = Link("tcp", register.geometry.rank_id, sender=sender)
        self._links.append(link)
        return link

    async def write(self, link: Link, plan, room: int, generation: int) -> int:
        """Move every byte of ``plan``; returns only when all of it landed."""
        if link.transport == "shm":
            from pd_transfer.transport.copy_engine import execute
            return await asyncio.to_thread(execute, plan, self.local_regions, link.dst_regions)
        return await link.sender.write(plan, self.local_regions, room=room, generation=generation)

    def close(self) -> None:
        for link in self._links:
            if link.sender is not None and hasattr(link.sender, "close"):
                link.sender.close()
            link.close()
        if self._receiver is not None:
            self._receiver.stop()
        for segment in self._local_segments:
            segment.close()
        self.local_regions = {}
