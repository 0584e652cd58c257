"""Staging for the Mooncake and NIXL transports: what both share, on either side.

Prefill side (per link): :func:`attach` opens the staging channel a decode
peer published (:mod:`~pd_transfer.transport.engines.staging.sender`), registers the local ring with the engine
and measures the path; :func:`segments` cuts a plan into the batches that go
direct and those that go staged (in plan order); :func:`run_staged` writes the staged part and
turns a broken channel into a failed link. Which batches go staged:

- the transport's ``strategy`` mode forces all of them either way;
- otherwise a strategy the agent set for the destination region (per pool, at
  verdict time: :meth:`EngineLink.set_strategy`) decides;
- otherwise (a transport used on its own, as in the benchmarks) a batch is
  staged when its mean joined run is below the link's crossover
  (:func:`~pd_transfer.transport.engines.strategy.crossover_nbytes`).

A peer that published no staging area, or had no slot free, gets direct
writes only. Decode side: :class:`ReceiverStaging` owns the staging area and
its :class:`~pd_transfer.transport.engines.staging.receiver.StagingReceiver` for an engine receiver.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import TransferPlan
from pd_transfer.transport.base import Receiver, RoomId, wire_room
from pd_transfer.transport.copy.packing import layout_chunks
from pd_transfer.transport.engines.address import EngineAddress
from pd_transfer.transport.engines.probe import measure_path
from pd_transfer.transport.engines.staging.receiver import (
    DEFAULT_AREA_SLOTS,
    DEFAULT_SLOT_NBYTES,
    StagingArea,
    StagingReceiver,
)
from pd_transfer.transport.engines.staging.sender import (
    DEFAULT_RING_SLOTS,
    Bulk,
    StagingChannel,
    Submit,
    open_channel,
    write_staged,
)
from pd_transfer.transport.engines.strategy import (
    PathCost,
    Strategy,
    StrategyMode,
    crossover_nbytes,
    staged_batches,
)
from pd_transfer.transport.receiver_rooms import ReceiverRooms
from pd_transfer.transport.tcp.sockets import Authenticator

if TYPE_CHECKING:
    from pd_transfer.transport.engines.link import EngineLink

log = logging.getLogger(__name__)

_AUTH_REFUSALS = frozenset({Reason.AUTH_FAILED, Reason.AUTH_REPLAYED, Reason.UNAUTHENTICATED})


@dataclass(frozen=True)
class StagingOptions:
    """The prefill side's staging settings, shared by both engine transports."""

    mode: StrategyMode = StrategyMode.AUTO
    ring_slots: int = DEFAULT_RING_SLOTS
    auth: Authenticator | None = None
    timeout_s: float = 60.0
    handshake_timeout_s: float = 10.0


@dataclass
class LinkStaging:
    """A link's staging channel, the measured path and the strategies set for it."""

    channel: StagingChannel
    cost: PathCost | None
    crossover_nbytes: float
    unregister: Callable[[int], None]  # takes the local ring away from this side's engine
    by_region: dict[str, Strategy] = field(default_factory=dict)  # destination region -> set

    def close(self) -> None:
        """Close the channel; the local ring goes with it."""
        self.channel.close()
        self.unregister(self.channel.local_base)


async def attach(
    link: EngineLink,
    address: EngineAddress,
    options: StagingOptions,
    *,
    submit: Submit,
    register: Callable[[dict], None],
    unregister: Callable[[int], None],
) -> None:
    """Give ``link`` a staging channel if the peer offers one (else it stays direct-only).

    ``register`` registers the local ring with this side's engine, ``unregister`` takes
    it back when the staging closes; ``submit`` writes descriptors through it (for the
    probe). A peer that offers staging but cannot be reached or probed is logged and
    written directly.
    """
    peer_id = link.peer.peer_id
    if options.mode is StrategyMode.DIRECT or not address.control or address.staging is None:
        return
    channel = await _open(peer_id, address.control, address.staging, options)
    if channel is None:
        return
    try:
        await asyncio.to_thread(register, {f"staging:{peer_id}": (channel.local_base, channel.local.nbytes)})
        cost = await asyncio.to_thread(measure_path, channel, submit)
    except TransportError as err:
        channel.close()
        log.warning(
            "staging path to %s failed its probe, writing directly: %s",
            peer_id,
            err.message,
            extra={"peer": peer_id},
        )
        return
    crossover = crossover_nbytes(
        cost,
        slot_nbytes=channel.slot_nbytes,
        batch_descriptors=link.descriptors_per_batch,
        ring_slots=len(channel.slots),
    )
    link.staging = LinkStaging(channel, cost, crossover, unregister)
    log.info(
        "staging to %s: %d slots of %d B; %s; staged below a mean run of %.0f B",
        peer_id,
        len(channel.slots),
        channel.slot_nbytes,
        cost.describe(),
        crossover,
        extra={"peer": peer_id},
    )


async def _open(
    peer_id: str, control: str, staging: tuple[int, int, int], options: StagingOptions
) -> StagingChannel | None:
    """The peer's staging channel, or None (logged) when it is unusable or has no slot
    free; a refused handshake raises (it is the peer's verdict, not a fallback)."""
    try:
        channel = await asyncio.to_thread(
            open_channel,
            control,
            staging,
            peer_id,
            auth=options.auth,
            ring_slots=options.ring_slots,
            timeout_s=options.timeout_s,
            handshake_timeout_s=options.handshake_timeout_s,
        )
    except TransportError as err:
        if err.code in _AUTH_REFUSALS:  # a refused handshake is the peer's verdict, not a fallback
            raise
        log.warning(
            "staging channel of %s unusable, writing directly: %s",
            peer_id,
            err.message,
            extra={"peer": peer_id},
        )
        return None
    if channel is None:
        log.warning("%s has no staging slot free: writing directly", peer_id, extra={"peer": peer_id})
    return channel


def segments(plan, link, mode: StrategyMode) -> list[tuple[Strategy, TransferPlan]]:
    """``plan`` as consecutive parts, each written one way, in plan order.

    Order matters: the aux row comes last in a room's plan (its arrival means
    everything before it landed), so a direct aux after staged KV is written
    only once decode acknowledged the KV.
    """
    staging: LinkStaging | None = link.staging
    if not plan.batches:
        return []
    if staging is None or mode is StrategyMode.DIRECT:
        return [(Strategy.DIRECT, plan)]
    if mode is StrategyMode.STAGED:
        return [(Strategy.STAGED, plan)]
    chosen = [staging.by_region.get(b.dst_region) for b in plan.batches]
    decided: list[Strategy]
    if any(c is None for c in chosen):
        auto = staged_batches(plan, staging.crossover_nbytes).tolist()
        decided = [
            c if c is not None else (Strategy.STAGED if a else Strategy.DIRECT) for c, a in zip(chosen, auto)
        ]
    else:
        decided = [c for c in chosen if c is not None]  # (every one is)
    out: list[tuple[Strategy, list]] = []
    for batch, strategy in zip(plan.batches, decided):
        if out and out[-1][0] is strategy:
            out[-1][1].append(batch)
        else:
            out.append((strategy, [batch]))
    return [
        (strategy, TransferPlan(plan.src_rank, plan.dst_rank, tuple(batches))) for strategy, batches in out
    ]


def staged_layouts(link, staged: TransferPlan | None, src: dict) -> list:
    """The staged part cut into slot-sized chunks, bounds-checked on both sides first."""
    if staged is None:
        return []
    geometry = link.peer.region_nbytes
    dst_sizes = {r: min(n, geometry[r]) for r, (_, n) in link.dst_bases.items() if r in geometry}
    return layout_chunks(
        staged, {r: m.nbytes for r, m in src.items()}, link.staging.channel.slot_nbytes, dst_sizes=dst_sizes
    )


def run_staged(link, layouts: list, src: dict, bulk: Bulk, *, room: str, generation: int) -> int:
    """Write ``layouts`` through the link's channel; a broken channel fails the link."""
    channel = link.staging.channel
    try:
        return write_staged(channel, layouts, src, bulk, room=room, generation=generation)
    except TransportError:
        if channel.broken is not None and link.failed is None:
            link.failed = channel.broken
            log.warning("%s", channel.broken.message, extra={"peer": link.peer.peer_id})
        raise


class ReceiverStaging:
    """An engine receiver's staging area and control channel (decode side)."""

    def __init__(
        self,
        num_slots: int = DEFAULT_AREA_SLOTS,
        slot_nbytes: int = DEFAULT_SLOT_NBYTES,
        *,
        bind_host: str = "127.0.0.1",
        auth: Authenticator | None = None,
        handshake_timeout_s: float = 10.0,
        max_pending: int = 64,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.num_slots, self.slot_nbytes = num_slots, slot_nbytes
        self.bind_host, self.auth = bind_host, auth
        self.handshake_timeout_s, self.max_pending = handshake_timeout_s, max_pending
        self.on_bad_frame = on_bad_frame
        self.area: StagingArea | None = None
        self.receiver: StagingReceiver | None = None

    async def start(
        self, regions, register: Callable[[dict], None], admission: ReceiverRooms | None = None
    ) -> tuple[str, tuple | None]:
        """Register the area and serve it: ``(control address, published area)``.

        ``admission``: the engine receiver's room book, which staged chunks answer to."""
        if self.num_slots <= 0:
            return "", None
        self.area = StagingArea(self.num_slots, self.slot_nbytes)
        await asyncio.to_thread(register, {"staging": (self.area.address, self.area.buffer.nbytes)})
        self.receiver = StagingReceiver(
            regions,
            self.area,
            bind_host=self.bind_host,
            auth=self.auth,
            handshake_timeout_s=self.handshake_timeout_s,
            max_pending=self.max_pending,
            on_bad_frame=self.on_bad_frame,
            admission=admission,
        )
        return await self.receiver.start(), self.area.published

    async def stop(self, unregister: Callable[[int], None] | None) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
            self.receiver = None
        if self.area is not None and unregister is not None:
            unregister(self.area.address)
        self.area = None


async def write_parts(transport, link, engine, plan, src_regions, room: RoomId, generation: int) -> int:
    """An engine transport's write: its source regions registered with the engine once,
    the plan cut into direct and staged parts (:func:`segments`), and every part submitted
    in plan order by ``transport._submit_all`` in a worker thread that ``Link.drain``
    waits for; returns the bytes written."""
    where = f"room {room} gen {generation} plan {plan.src_rank} -> {link.peer.peer_id}"
    src = transport._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
    bases = {r: (int(m.array.ctypes.data), m.nbytes) for r, m in src.items()}
    if engine.unregistered(bases):  # first write from these regions: pinning may take a while
        await asyncio.to_thread(engine.register, bases)
    parts = segments(plan, link, transport.staging.mode)
    nbytes = await link.run_background(
        asyncio.to_thread(
            transport._submit_all, engine, link, parts, bases, src, where, wire_room(room), generation
        )
    )
    link.nbytes_written += nbytes
    link.num_writes += 1
    return nbytes


class ReceiverEngine(Protocol):
    """What :class:`EngineReceiver` calls on its engine (MooncakeEngine, NixlEngine)."""

    def unregister(self, address: int) -> None: ...

    def close(self) -> None: ...


class EngineReceiver(Receiver):
    """What the mooncake and nixl receivers share once started: fencing staged chunks,
    and stopping (unregistering their regions, closing the engine when they own it).

    Direct engine writes land without this side knowing (one-sided), so only staged
    chunks answer to :attr:`admission`; a fence waits for those (direct writes are the
    writer's to drain, :meth:`~pd_transfer.transport.base.Link.drain`). Subclasses set
    ``engine``, ``staging``, ``_owns_engine`` and ``_bases``, and start the staging
    channel with :attr:`admission`.
    """

    engine: ReceiverEngine | None = None
    staging: ReceiverStaging
    _owns_engine: bool
    _bases: dict[str, tuple[int, int]]

    async def _settle(self, room: str, generation: int) -> None:
        if self.staging.receiver is not None:
            await self.staging.receiver._settle(room, generation)

    def unregister(self, address: int) -> None:
        """Take one region away from the engine (tests: make the engine fail a write)."""
        if self.engine is not None:
            self.engine.unregister(address)

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        await self.staging.stop(engine.unregister)
        if self._owns_engine:
            await asyncio.to_thread(engine.close)
        else:
            for address, _ in self._bases.values():
                engine.unregister(address)
