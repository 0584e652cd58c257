"""The one interface every data plane implements.

A :class:`Transport` moves the bytes of a planned transfer
(:class:`~pd_transfer.layout.lowering.TransferPlan`) from this process's
regions into a peer's registered regions. The agent uses it like this::

    transport = ShmTransport()                      # or TcpTransport(), MockTransport(...)
    link = await transport.connect(peer_endpoint)   # once per peer pair, after the verdict
    nbytes = await transport.write(link, plan, my_regions, room=7, generation=0)
    ...
    await transport.close()                         # closes every link

Receiving side (:class:`Receiver`): ``shm`` needs nothing running (the decode worker publishes
its segment names as region handles and the writer maps them); ``tcp`` needs
a :class:`~pd_transfer.transport.tcp.receiver.TcpReceiver` serving the
decode rank's regions at the address the peer connects to; ``mock`` writes
into regions registered with it in-process; ``mooncake`` and ``nixl`` need a
receiver (:mod:`~pd_transfer.transport.engines.mooncake`, :mod:`~pd_transfer.transport.engines.nixl`) that registers the decode rank's
regions with the engine and publishes them as the ``data_address``.

Contracts every implementation keeps:

- ``write`` returns only when every byte of the plan has landed in the
  destination, and returns the number of bytes written;
- it never blocks the event loop: heavy copies run in ``asyncio.to_thread``;
- it checks every run against the destination regions before a byte moves
  (locally for shm and mock, on arrival for tcp) and raises
  :class:`~pd_transfer.errors.TransportError` with a stable ``code`` on any
  failure; third-party exceptions (zmq, OSError) are translated at this edge;
- a write whose caller is cancelled (a room timeout) may still finish in the
  background: :meth:`Link.drain` waits until nothing this link started can
  still write, which is what an abort must wait for before it tells decode
  that its pages are free again.

The invariants every transport keeps (tested once for each, in
``tests/transport/test_transport_invariants.py``):

(a) **the aux row lands last.** A room's plan ends with its aux row; its
    last run lands after every other byte of the plan, whatever runs in
    parallel (copy threads, tcp lanes, a receiver's scatter threads), so a
    reader that sees the aux row sees the whole room;
(b) **no byte outside a registered region.** Every run is checked against
    the destination's registered sizes before the first byte of the write
    moves; a plan with one run out of bounds is refused
    (``RUN_OUT_OF_REGION``) and writes nothing;
(c) **a fenced room takes no late byte.** Where a :class:`Receiver` lands
    the bytes, once :meth:`Receiver.fence` returns no chunk of that room
    generation can land and later ones are refused (``STALE_GENERATION``);
    where the writer writes in place (shm, device, mock, engines' direct
    writes) the abort waits for :meth:`Link.drain` instead.

This layer may import numpy, torch, zmq and asyncio; never ``pd_transfer.agent``
or ``pd_transfer.protocol``.
"""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeAlias, TypeVar

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.receiver_rooms import ByteRanges, ReceiverRooms, RoomPolicy
from pd_transfer.transport.regions import MappedCache, Regions

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan
    from pd_transfer.memory.segments import Segment

T = TypeVar("T")

#: a room's id: the int the worker API and the protocol carry, through this interface too
RoomId: TypeAlias = int


def wire_room(room: RoomId) -> str:
    """``room`` as the data plane's frames and a receiver's room book key it (decimal text):
    the one place a room id becomes a string."""
    return str(room)


L = TypeVar("L", bound="Link")


class TransportKind(enum.Enum):
    SHM = "shm"
    TCP = "tcp"
    MOCK = "mock"
    MOONCAKE = "mooncake"  # optional extra: Mooncake Transfer Engine
    NIXL = "nixl"  # optional extra: NIXL (UCX)
    DEVICE = "device"  # same host, CUDA IPC handles: torch copies


@dataclass(frozen=True)
class PeerRegion:
    """One destination region of a peer: its id, size and, on the same host, its segment."""

    region_id: str
    nbytes: int
    segment: str = ""  # shm segment name; empty when the region is not shared memory


@dataclass(frozen=True)
class PeerEndpoint:
    """Everything a transport needs to reach one destination rank.

    Built by the agent from the peer's registration: ``regions`` from its
    geometry (sizes) and region handles (segments), ``data_address`` from the
    address its tcp receiver serves (``tcp://127.0.0.1:5601``).
    """

    peer_id: str
    regions: tuple[PeerRegion, ...] = ()
    data_address: str = ""
    _by_id: dict[str, PeerRegion] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {r.region_id: r for r in self.regions})

    @classmethod
    def from_maps(
        cls,
        peer_id: str,
        region_nbytes: Mapping[str, int],
        segments: Mapping[str, str] | None = None,
        data_address: str = "",
    ) -> PeerEndpoint:
        segments = segments or {}
        return cls(
            peer_id,
            tuple(PeerRegion(r, int(n), segments.get(r, "")) for r, n in region_nbytes.items()),
            data_address,
        )

    def region(self, region_id: str) -> PeerRegion | None:
        return self._by_id.get(region_id)

    @property
    def region_nbytes(self) -> dict[str, int]:
        return {r.region_id: r.nbytes for r in self.regions}


class Link(ABC):
    """One connected peer. Created by :meth:`Transport.connect`, closed by :meth:`close`."""

    #: a plan of at most this many runs may come as a grid plan (copied by the native
    #: loop in one call); 0: this link takes none
    grid_max_runs: int = 0
    #: the link writes straight into the peer's memory on this host (shm, CUDA IPC), so
    #: the peer's doorbells may be rung once a write returned
    in_place: ClassVar[bool] = False

    def __init__(self, transport: Transport, peer: PeerEndpoint) -> None:
        self.transport = transport
        self.peer = peer
        self.nbytes_written = 0
        self.num_writes = 0
        self._closed = False
        self._inflight: set[asyncio.Future[Any]] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Stop using the link; waits for writes still running in threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.transport._links.discard(self)
        await self.drain()
        await self._release()

    async def drain(self) -> None:
        """Return when no work this link started can still write a byte."""
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    def run_background(self, work: Awaitable[T]) -> asyncio.Future[T]:
        """Run ``work`` so that cancelling its awaiter does not cancel it; :meth:`drain` waits."""
        future = asyncio.ensure_future(work)
        self._inflight.add(future)
        future.add_done_callback(self._settled)
        return asyncio.shield(future)

    def _settled(self, future: asyncio.Future[Any]) -> None:
        self._inflight.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: the awaiter (if still there) re-raises it

    def forget_sources(self) -> None:
        """Drop whatever this link keeps of this sidecar's own regions (nothing by default)."""
        return

    def mapped_segments(self) -> Mapping[str, Segment]:
        """The peer's shared-memory segments this link mapped into this process, by region
        (shm links); none for a link that reaches its peer's memory any other way."""
        return {}

    def check_open(self) -> None:
        if self._closed:
            raise TransportError(f"link to {self.peer.peer_id} is closed", code=Reason.LINK_CLOSED)

    @abstractmethod
    async def _release(self) -> None:
        """Free what the link holds (mappings, sockets)."""

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} to {self.peer.peer_id} {state}>"


class Transport(ABC):
    """A data plane. One instance per sidecar; one :class:`Link` per peer."""

    kind: TransportKind  # a class's own (a wrapper takes the kind of what it wraps)

    def __init__(self) -> None:
        self._links: set[Link] = set()
        self._sources = MappedCache()  # this sidecar's own regions, validated once

    @property
    def name(self) -> str:
        return self.kind.value

    @abstractmethod
    async def connect(self, peer: PeerEndpoint) -> Link:
        """Open a link to ``peer``; raises TransportError if it cannot be reached or mapped."""

    @abstractmethod
    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        """Move every byte of ``plan`` from ``src_regions`` into the peer; return the count.

        Returns only when every byte has landed in the destination. Raises
        :class:`TransportError` (never a bare zmq or OS error). ``room`` and
        ``generation`` label the bytes so the receiver can refuse writes of an
        aborted generation.
        """

    async def close(self) -> None:
        """Close every link this transport opened."""
        links, self._links = list(self._links), set()
        for link in links:
            await link.close()
        self._sources.clear()

    def forget_sources(self) -> None:
        """This sidecar's own regions are gone (its worker exited): drop every view of them
        this transport keeps, so that they can be unmapped."""
        self._sources.clear()
        for link in self._links:
            link.forget_sources()

    def _adopt(self, link: L) -> L:
        self._links.add(link)
        return link

    def _own(self, link: Link, link_type: type[L]) -> L:
        if not isinstance(link, link_type) or link.transport is not self:
            raise TransportError(
                f"{link!r} was not opened by this {self.name} transport", code=Reason.LINK_CLOSED
            )
        link.check_open()
        return link


class Receiver(ABC):
    """The decode side of a transport that needs something running to receive.

    One per decode rank (tcp, its ZeroMQ/CURVE variant, the engines' staging
    channel, the mooncake and nixl receivers); the agent drives each the
    same way::

        receiver = TcpReceiver(host, regions, policy=RoomPolicy.EXPECTED)
        address = await receiver.start()        # published to prefill peers
        receiver.expect(7, 0, ranges)            # before asking prefill for the room
        ...                                      # chunks land; the room completes
        receiver.forget(7)                       # its later chunks are refused
        await receiver.fence(8, 3)               # abort: no byte of room 8 <= 3 lands after this
        await receiver.stop()

    Which chunk may land where is one book, :attr:`admission`
    (:class:`~pd_transfer.transport.receiver_rooms.ReceiverRooms`), shared by
    every receiver. Contracts:

    - :meth:`start` binds and serves; it returns the address peers connect to
      (for an engine, its encoded region table). :meth:`stop` stops accepting,
      ends every connection and waits for every chunk already landing; after
      it no byte is written. :meth:`close` is :meth:`stop` (both idempotent).
    - :meth:`expect`, :meth:`forget` and :meth:`forget_room` are called from
      the event loop and may not block: they only update the room book (under
      its lock; connection threads read it).
    - a chunk is admitted, then written, then released; the admission checks
      (in one step under the book's lock) that every run lies inside a
      registered region and, for an expected room, inside that room's
      ranges, and that the room is not fenced. A refused chunk writes
      nothing; its transfer fails with the reason and the receiver keeps
      serving every other peer.
    - :meth:`fence` is called from the event loop and may wait (it never
      blocks the loop): once it returns, no chunk of ``room`` at a generation
      ``<= generation`` can still land. A chunk admitted before the fence is
      waited for (:meth:`_settle`); one arriving after it is refused with
      ``STALE_GENERATION``. This is what decode waits for before it hands an
      aborted room's pages back to its worker.
    - the aux row (a room's last piece) is the writer's to order: a sender
      writes it only after every other byte of the room was acknowledged, so
      a receiver that lands chunks in arrival order lands it last.
    """

    def __init__(self, policy: RoomPolicy = RoomPolicy.ANY, admission: ReceiverRooms | None = None) -> None:
        self.admission = admission if admission is not None else ReceiverRooms(policy)
        self.address = ""

    # -- lifecycle ----------------------------------------------------------------------
    @abstractmethod
    async def start(self) -> str:
        """Bind and start serving; return the address peers connect to."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop serving; returns once no byte can be written any more (idempotent)."""

    async def close(self) -> None:
        await self.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- rooms (see ReceiverRooms; event loop, never blocking) -----------------------------
    def expect(self, room: RoomId, generation: int, ranges: Mapping[str, ByteRanges]) -> None:
        """Admit chunks of ``room`` at ``generation``, only inside ``ranges`` (per region)."""
        self.admission.expect(wire_room(room), generation, ranges)

    def forget(self, room: RoomId) -> None:
        """The room is finished: refuse its later chunks."""
        self.admission.forget(wire_room(room))

    def forget_room(self, room: RoomId) -> None:
        """Drop the fence and expectation of a room that is finished for good."""
        self.admission.forget_room(wire_room(room))

    async def fence(self, room: RoomId, generation: int) -> None:
        """Refuse every later chunk of ``room`` with a generation <= ``generation``.

        Returns once no chunk of it can still be written.
        """
        key = wire_room(room)
        self.admission.fence(key, generation)
        await self._settle(key, generation)

    async def _settle(self, room: str, generation: int) -> None:
        """Wait until no chunk of ``room`` (its :func:`wire_room` key) up to ``generation``
        admitted before the fence is still landing (off the event loop)."""
        if self.admission.busy(room, generation):
            await asyncio.to_thread(self.admission.wait_idle, room, generation, None)
