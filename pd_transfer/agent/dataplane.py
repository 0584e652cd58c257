"""The sidecar's data plane: maps regions and picks a transport per peer pair.

At worker registration the sidecar maps its own worker's regions (shared
memory segments, or CUDA IPC handles on a GPU). A decode sidecar also starts
a tcp receiver for peers on other hosts. When prefill accepts a decode peer it
picks the transport for the pair with
:func:`~pd_transfer.transport.choice.choose_transport` (policy only): ``shm``
when both sidecars are on the same host (equal ``host_id``) and the peer
published its region handles, ``tcp`` otherwise or when configured; then it
opens a link of that kind, from its transports held by kind. Device (CUDA)
regions are copied with torch on the device (the shm and device transports
take device sources). With an engine transport (mooncake, nixl) the pair's link also
decides per pool between direct runs and staging (:mod:`.strategies`), and a
decode sidecar publishes a staging area with its engine address.

Every remote offset and length is bounds-checked against the registered
region sizes before a byte moves (by the copy engines, and for tcp again by
the receiver).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zmq.asyncio

from pd_transfer.agent.strategies import choose_strategies, receiver_staging, staging_options
from pd_transfer.agent.tcp_plane import tcp_receiver, tcp_transport
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import PdTransferError, Reason, TransportError
from pd_transfer.layout.geometry import RankGeometry, Role
from pd_transfer.layout.views import Pool
from pd_transfer.memory import cuda_ipc
from pd_transfer.memory import segment_guard as shm_guard
from pd_transfer.memory.doorbell import AVAILABLE as DOORBELLS_AVAILABLE
from pd_transfer.memory.doorbell import Doorbells
from pd_transfer.memory.segments import Segment, open_segment
from pd_transfer.observability.listeners import listening
from pd_transfer.protocol import Register
from pd_transfer.transport.base import Link, PeerEndpoint, Receiver, RoomId, Transport, TransportKind
from pd_transfer.transport.choice import (
    ENGINE_KINDS,
    LocalPlane,
    PeerOffer,
    TransportRefusal,
    choose_transport,
)
from pd_transfer.transport.copy import native_loop
from pd_transfer.transport.copy.copy_engine import CopyEngine
from pd_transfer.transport.device import DeviceTransport
from pd_transfer.transport.engines.registry import make_receiver, make_transport
from pd_transfer.transport.engines.strategy import StrategyMode
from pd_transfer.transport.fault_injection import CorruptingTransport, CorruptNth
from pd_transfer.transport.receiver_rooms import item_ranges
from pd_transfer.transport.shm import ShmTransport
from pd_transfer.transport.tcp.receiver import TcpReceiver
from pd_transfer.transport.zmq.receiver import ZmqTcpReceiver

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan
    from pd_transfer.layout.planner import PairPlanner
    from pd_transfer.transport.engines.strategy import StrategyChoice
    from pd_transfer.transport.regions import RegionMemory

log = logging.getLogger(__name__)


class SegmentTruncated(PdTransferError):
    """A mapped segment shrank under its mapping during a write (:mod:`pd_transfer.memory.segment_guard`):
    ``local`` when it is this sidecar's worker's, else the peer's (the peer is dropped)."""

    default_code = Reason.SEGMENT_TRUNCATED

    def __init__(self, message: str, *, local: bool, hint: str = "") -> None:
        super().__init__(message, code=Reason.SEGMENT_TRUNCATED, hint=hint)
        self.local = local


class DataPlane:
    """This sidecar's transports, one per kind (shm, tcp, device and the configured engine),
    the receivers a decode rank serves (tcp, and the engine's) and its worker's regions."""

    def __init__(
        self,
        config: SidecarConfig,
        context: zmq.asyncio.Context,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_connection_closed: Callable[[str], None] = lambda socket: None,
    ) -> None:
        self.config = config
        self.context = context
        self._on_bad_frame = on_bad_frame  # frames the tcp receiver refused unread
        self._on_connection_closed = on_connection_closed  # the tcp receiver's ended connections
        self.local_regions: dict[str, RegionMemory] = {}
        self.on_device = False
        self._segments: list[Segment] = []
        # sticky while the worker's registration lasts (its pages are zeros), and /readyz says so
        self._local_truncated: SegmentTruncated | None = None
        self._copies = CopyEngine(num_workers=config.copy_threads)
        self._transports: dict[TransportKind, Transport] = {
            TransportKind.SHM: ShmTransport(self._copies),
            # plain sockets, or ZeroMQ when CURVE is configured (it encrypts): see tcp_plane
            TransportKind.TCP: tcp_transport(config, context),
            TransportKind.DEVICE: DeviceTransport(),  # CUDA IPC handles of a same-host peer
        }
        if config.fault_corrupt_nth:  # TEST ONLY: the sidecar's nth shm or tcp write lands one byte wrong
            fault = CorruptNth(config.fault_corrupt_nth)
            for kind in (TransportKind.SHM, TransportKind.TCP):
                self._transports[kind] = CorruptingTransport(self._transports[kind], fault)
        # transport mooncake or nixl: the engine writes (prefill) or receives (decode) everything
        self._engine = ENGINE_KINDS.get(config.transport)
        self.engine_listeners: list[str] = []  # what the engine listens on, measured at its start
        if self._engine is not None:
            before = listening()
            self._transports[self._engine] = make_transport(
                config.transport,
                host=config.data_host,
                port=config.data_port,
                protocol=config.mooncake_protocol,
                staging=staging_options(config, context),
                ucx_threads=config.nixl_ucx_threads,
            )
            self.engine_listeners = [str(s) for s in sorted(listening() - before)]
        self._tcp_receiver: TcpReceiver | ZmqTcpReceiver | None = None  # decode, tcp
        self._engine_receiver: Receiver | None = None  # decode, an engine transport
        self._geometry: RankGeometry | None = None

    @property
    def copies(self) -> str:
        """How shm copies run here: the native loop, or numpy and why."""
        return native_loop.describe(self._copies.native)

    def transport_names(self) -> tuple[str, ...]:
        return ("shm", "tcp") + ((self.config.transport,) if self._engine is not None else ())

    # -- local regions ----------------------------------------------------------------
    async def map_local(self, geometry: RankGeometry, handles: dict[str, str]) -> None:
        """Map the worker's regions (refusing any smaller than what it registered).

        In a thread: pre-faulting GiBs of pool pages, or initializing CUDA for the
        first handle, takes long enough to starve the loop's heartbeats."""
        regions, segments, on_device = await asyncio.to_thread(_open_local, geometry, handles)
        self._segments, self.local_regions = segments, regions
        self._local_truncated = None  # a new registration's pools: what shrank before is gone
        if segments and not shm_guard.available():
            log.warning(
                "mapped segments are not watched for SIGBUS (%s): a segment truncated "
                "under its mapping kills this sidecar",
                shm_guard.why_unavailable(),
            )
        self.on_device = self.on_device or on_device
        if geometry.role is Role.DECODE and self.config.transport in ("auto", "tcp") and not self.on_device:
            self._tcp_receiver = tcp_receiver(
                self.config, self.local_regions, self.context, self._on_bad_frame, self._on_connection_closed
            )
            self._geometry = geometry
            await self._tcp_receiver.start()
        if geometry.role is Role.DECODE and self._engine is not None and not self.on_device:
            if self._engine_receiver is not None:  # re-registered: the old regions go
                await self._engine_receiver.stop()
            self._engine_receiver = make_receiver(
                self.config.transport,
                self.local_regions,
                host=self.config.data_host,
                port=self.config.data_port,
                protocol=self.config.mooncake_protocol,
                transport=self._transports[self._engine],  # one engine per sidecar, started before serving
                staging=receiver_staging(self.config, self.context, self._on_bad_frame),
            )
            await self._engine_receiver.start()

    async def unmap_local(self) -> None:
        """The worker is gone: stop receiving into its regions, then unmap them (the
        pages go back to the kernel once the worker and the peers unmapped them too)."""
        if self._tcp_receiver is not None:
            await self._tcp_receiver.stop()
            self._tcp_receiver = None
        if self._engine_receiver is not None:
            await self._engine_receiver.stop()
            self._engine_receiver = None
        for transport in self._transports.values():
            transport.forget_sources()
        for segment in self._segments:
            segment.close()
        self._segments, self.local_regions, self._geometry = [], {}, None
        self._local_truncated = None  # it named the segments just let go

    async def fence(self, room: RoomId, generation: int) -> None:
        """Refuse late tcp chunks of ``room`` up to ``generation`` (no-op without a receiver)."""
        if self._tcp_receiver is not None:
            await self._tcp_receiver.fence(room, generation)
        if self._engine_receiver is not None:  # staged chunks (engine writes: prefill drains)
            await self._engine_receiver.fence(room, generation)

    async def expect(self, room: RoomId, generation: int, dst: dict[Pool, np.ndarray]) -> None:
        """Tell the tcp receiver ``room`` may write its pages ``dst`` (no-op without one);
        a chunk of a room it was not told about, or outside them, is refused."""
        if self._tcp_receiver is None or self._geometry is None:
            return
        views = self._geometry.views
        if sum(len(i) for i in dst.values()) * len(views) > 100_000:  # big rooms: off the loop
            ranges = await asyncio.to_thread(item_ranges, views, dst)
        else:
            ranges = item_ranges(views, dst)
        self._tcp_receiver.expect(room, generation, ranges)

    def forget(self, room: RoomId) -> None:
        """``room`` landed: the tcp receiver refuses its later chunks."""
        if self._tcp_receiver is not None:
            self._tcp_receiver.forget(room)

    def receive_address(self) -> str:
        if self._engine_receiver is not None:  # the engine's address and region table
            return self._engine_receiver.address
        return self._tcp_receiver.address if self._tcp_receiver is not None else ""

    # -- links ----------------------------------------------------------------------
    async def connect(self, register: Register) -> Link:
        """A link to the decode peer of ``register``, of the kind :func:`choose_transport`
        picks (a refusal raises TransportError with its code); a failure to reach or map
        the peer raises the transport's own TransportError, its code kept."""
        handles = {h.region: h.handle for h in register.region_handles}
        peer_id = register.geometry.rank_id
        offer = PeerOffer(
            peer_id,
            register.host_id,
            bool(handles),
            any(cuda_ipc.is_cuda_handle(h) for h in handles.values()),
        )
        kind = choose_transport(offer, LocalPlane(self.config.transport, self.config.host_id, self.on_device))
        if isinstance(kind, TransportRefusal):
            raise kind.error()
        sizes = {r.id: r.nbytes for r in register.geometry.regions}
        if kind in (TransportKind.SHM, TransportKind.DEVICE):  # the peer's memory, mapped here
            endpoint = PeerEndpoint.from_maps(peer_id, sizes, handles)
        else:
            endpoint = PeerEndpoint.from_maps(peer_id, sizes, None, register.data_address)
        try:
            return await self._transports[kind].connect(endpoint)
        except TransportError as err:  # its code kept: the verdict's mismatch record says it
            raise TransportError(
                f"cannot reach {peer_id}: {err.message}", code=err.code, hint=err.hint
            ) from None

    def doorbells(self, link: Link, name: str) -> Doorbells | None:
        """The decode peer's doorbells (named in its Register), mapped when this link writes
        into its memory in place (shm, CUDA IPC) and doorbells are on; else None."""
        if not (name and self.config.doorbell and DOORBELLS_AVAILABLE and link.in_place):
            return None
        try:
            return Doorbells.open(name)
        except PdTransferError as err:  # not fatal: its rooms end through Done alone
            log.warning("cannot map the doorbells of %s: %s", link.peer.peer_id, err.message)
            return None

    def strategies(self, link: Link, planner: PairPlanner) -> dict[Pool, StrategyChoice]:
        """``{pool: StrategyChoice}``: how each pool moves over ``link`` (set on engine links);
        see :mod:`.strategies`. Report it in the verdict, metrics and log."""
        kind = link.transport.name
        return choose_strategies(link, planner, StrategyMode(self.config.strategy), kind)

    async def write(self, link: Link, plan: TransferPlan, room: RoomId, generation: int) -> int:
        """Move every byte of ``plan``; returns only when all of it landed.

        A segment truncated under its mapping meanwhile (on either side) fails the
        write with :class:`SegmentTruncated`, never the process (:mod:`pd_transfer.memory.segment_guard`)."""
        if self._local_truncated is not None:
            raise self._local_truncated
        if not shm_guard.available():
            self._check_sizes(link)
        before = shm_guard.faults_total()
        try:
            nbytes = await self._write(link, plan, room, generation)
        except Exception:
            self._check_truncated(link, before)
            raise
        self._check_truncated(link, before)
        return nbytes

    def _check_sizes(self, link: Link) -> None:
        """Without the SIGBUS guard: refuse to copy into or out of a segment whose file is
        already smaller than its mapping (fstat per segment, before each write)."""
        local = [s.name for s in self._segments if s.shrunk()]
        peer = [s.name for s in link.mapped_segments().values() if s.shrunk()]
        if local or peer:
            whose = "this sidecar's worker" if local else f"peer {link.peer.peer_id}"
            raise SegmentTruncated(
                f"{whose} truncated its segment(s) {(local or peer)[:3]} "
                f"after registering them; nothing was copied",
                local=bool(local),
            )

    def local_truncated(self) -> SegmentTruncated | None:
        """Why this worker's mapped pools can no longer be trusted (a segment of them was
        truncated under the mapping and touched), or None; one memory read when not."""
        if self._local_truncated is None and shm_guard.faults_total():
            try:
                self._check_truncated(None, -1)
            except SegmentTruncated as err:
                return err
        return self._local_truncated

    def _check_truncated(self, link: Link | None, before: int) -> None:
        """Raise :class:`SegmentTruncated` if a copy since ``before`` faulted in the
        segments of ``link`` or of this worker (one memory read when none did)."""
        if shm_guard.faults_total() == before:
            return
        local = [s.name for s in self._segments if s.truncated]
        if local:
            self._local_truncated = SegmentTruncated(
                f"this sidecar's worker truncated its segment(s) {local[:3]} under the mapping "
                f"after registering them; what they held is lost here",
                local=True,
                hint="a worker must keep its pools' segments at their registered size; "
                "restart the worker (its new registration maps new pools)",
            )
            log.error("%s", self._local_truncated.message)
            raise self._local_truncated
        if link is None:
            return
        peer = [s.name for s in link.mapped_segments().values() if s.truncated]
        if peer:
            raise SegmentTruncated(
                f"peer {link.peer.peer_id} truncated its segment(s) {peer[:3]} under this "
                f"sidecar's mapping after registering them",
                local=False,
                hint="the peer must keep its segments at their registered size; its session is closed",
            )

    async def _write(self, link: Link, plan: TransferPlan, room: RoomId, generation: int) -> int:
        """A transport's TransportError goes to the caller as it is (its code says why)."""
        transport = self._transports[link.transport.kind]  # the one that opened it, or its wrapper
        return await transport.write(link, plan, self.local_regions, room=room, generation=generation)

    async def release(self, link: Link) -> None:
        """Close one peer's link (its session was lost or closed): unmaps what it mapped,
        after the writes it started (Link.drain)."""
        await link.close()

    async def close(self) -> None:
        for transport in self._transports.values():
            await transport.close()
        if self._engine_receiver is not None:
            await self._engine_receiver.stop()
        if self._tcp_receiver is not None:
            await self._tcp_receiver.stop()
        for segment in self._segments:
            segment.close()
        self.local_regions = {}


def _open_local(
    geometry: RankGeometry, handles: dict[str, str]
) -> tuple[dict[str, RegionMemory], list[Segment], bool]:
    """``(regions, segments, on_device)``: each region opened from its handle (a CUDA IPC
    handle or a shared-memory segment); on a failure the segments opened so far close."""
    regions: dict[str, RegionMemory] = {}
    segments: list[Segment] = []
    # host regions are numpy views; torch tensors only beside CUDA ones (torch copies them)
    on_device = any(cuda_ipc.is_cuda_handle(handles[region.id]) for region in geometry.regions)
    try:
        for region in geometry.regions:
            handle = handles[region.id]
            if cuda_ipc.is_cuda_handle(handle):
                regions[region.id] = cuda_ipc.open_handle(handle, region.nbytes)[: region.nbytes]
            else:
                segment = open_segment(handle, region.nbytes)
                segments.append(segment)
                memory = segment.tensor if on_device else segment.array
                regions[region.id] = memory[: region.nbytes]
    except PdTransferError:
        for segment in segments:
            segment.close()
        raise
    return regions, segments, on_device
