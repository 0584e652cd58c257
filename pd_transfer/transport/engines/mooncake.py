"""Mooncake Transfer Engine transport (optional: ``pip install 'pd-transfer[mooncake]'``).

Both sides run a ``mooncake.engine.TransferEngine`` with ``P2PHANDSHAKE``
metadata (no etcd or metadata server: the writer fetches the target's
segment description from the target's RPC port itself) over the ``tcp``
protocol, or ``rdma`` where RDMA NICs exist::

    receiver = MooncakeReceiver(decode_regions, host="127.0.0.1")  # decode side
    await receiver.start()              # registers every region with the engine once
    receiver.address                    # 'mooncake://127.0.0.1:15795/...', Register.data_address

    transport = MooncakeTransport(host="127.0.0.1")                # prefill side
    link = await transport.connect(PeerEndpoint.from_maps(rank, sizes, data_address=address))
    await transport.write(link, plan, prefill_regions)

A write lowers the plan to absolute addresses (bounds-checked against the
smaller of the peer's geometry and what its engine registered, before
anything is submitted), joins neighbouring runs, and posts them with
``batch_transfer_async_write`` in batches of at most ``max_batch_descriptors``
(default 1,024), keeping at most ``QUEUE_LIMIT`` descriptors in flight per
link: the engine's tcp path refuses a batch once about 2,048 transfers are
queued for a peer, and what it had already accepted of that batch keeps
writing. A write returns once every batch it posted has ended (an error
included), so no byte of it lands later. After an engine error the link
settles and probes (:mod:`~pd_transfer.transport.engines.link`). Plans of small runs go staged
instead where the peer offers a staging area (:mod:`~pd_transfer.transport.engines.staging.link_staging`):
gathered into 4 MiB slots, one descriptor each, scattered by decode.

The engine is imported only when a transport or receiver is built; without
the package this module still imports and says which extra to install.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind
from pd_transfer.transport.engines.address import EngineAddress
from pd_transfer.transport.engines.link import PROBE_LANDING, EngineLink, Recovery, check_published, recover
from pd_transfer.transport.engines.runs import (
    AddressRuns,
    batches,
    lower_to_addresses,
    region_bases,
    split_long,
)
from pd_transfer.transport.engines.staging.link_staging import (
    EngineReceiver,
    ReceiverStaging,
    StagingOptions,
    attach,
    run_staged,
    staged_layouts,
    write_parts,
)
from pd_transfer.transport.engines.strategy import Strategy
from pd_transfer.transport.regions import Regions

PROTOCOLS = ("tcp", "rdma")
QUEUE_LIMIT = 2048  # transfers the engine's tcp path queues per peer, by default
# per-peer queues deep enough for every descriptor of a large plan, as the fastest
# Mooncake-alone settings of benchmarks/engines_bench.py have them; the engine reads
# these when it starts; an operator's own values win.
TCP_QUEUES = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}
MAX_RUN_NBYTES = 64 << 20  # one descriptor at most (the engine slices it further)


def load_engine_class() -> type:
    """``mooncake.engine.TransferEngine``, or TransportError naming the extra to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        raise TransportError(
            f"the mooncake transport needs Mooncake's transfer engine ({err})",
            code=Reason.TRANSPORT_UNSUPPORTED,
            hint="pip install 'pd-transfer[mooncake]' (and apt-get install libibverbs1)",
        ) from None
    return TransferEngine


class MooncakeEngine:
    """One initialised TransferEngine and the memory registered with it."""

    def __init__(
        self, host: str = "127.0.0.1", protocol: str = "tcp", port: int = 0, device_name: str = ""
    ) -> None:
        if protocol not in PROTOCOLS:
            raise TransportError(
                f"mooncake protocol {protocol!r} is not one of {list(PROTOCOLS)}", code=Reason.INVALID_CONFIG
            )
        for name, value in TCP_QUEUES.items():
            os.environ.setdefault(name, value)
        self.engine = load_engine_class()()
        hostname = f"{host}:{port}" if port else host
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportError(
                f"mooncake engine did not start on {hostname} over {protocol} (rc {rc})",
                code=Reason.TRANSPORT_FAILED,
                hint="rdma needs RDMA NICs; use protocol tcp elsewhere",
            )
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}  # address -> nbytes
        self._lock = threading.Lock()
        self.scratch = PROBE_LANDING  # where probes read into: never freed (engines.link)
        self.register({"scratch": (int(self.scratch.ctypes.data), self.scratch.nbytes)})

    def register(self, bases: dict[str, tuple[int, int]]) -> None:
        """Register each ``(address, nbytes)`` not registered yet (once per buffer)."""
        with self._lock:
            for region_id, (address, nbytes) in bases.items():
                if self._registered.get(address) == nbytes:
                    continue
                if address in self._registered:
                    self.engine.unregister_memory(address)
                rc = self.engine.register_memory(address, nbytes)
                if rc != 0:
                    raise TransportError(
                        f"mooncake engine refused to register region {region_id!r} ({nbytes} bytes, rc {rc})",
                        code=Reason.REGION_INVALID,
                    )
                self._registered[address] = nbytes

    def unregistered(self, bases: dict[str, tuple[int, int]]) -> bool:
        return any(self._registered.get(a) != n for a, n in bases.values())

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is not None:
                self.engine.unregister_memory(address)

    def probe(self, target: str, remote_address: int) -> bool:
        """Read one byte of the peer's memory: does its engine answer?"""
        rc = self.engine.batch_transfer_sync_read(
            target, [int(self.scratch.ctypes.data)], [remote_address], [1]
        )
        return rc == 0

    def close(self) -> None:
        """Unregister every region and drop the TransferEngine now: its threads stop here, on
        the closing thread, not at whichever later garbage collection finds it."""
        with self._lock:
            for address in list(self._registered):
                self.engine.unregister_memory(address)
            self._registered.clear()
            self.engine = None


class MooncakeReceiver(EngineReceiver):
    """The decode side: registers the rank's regions once and publishes them.

    ``engine``: share a started engine (the sidecar's own transport's, see
    :meth:`MooncakeTransport.start`) instead of starting one; stopping the
    receiver then unregisters its regions and leaves the engine running.
    """

    engine: MooncakeEngine | None

    def __init__(
        self,
        regions: Regions,
        host: str = "127.0.0.1",
        port: int = 0,
        protocol: str = "tcp",
        engine: MooncakeEngine | None = None,
        staging: ReceiverStaging | None = None,
    ) -> None:
        super().__init__()
        self.regions = regions
        self.host, self.port, self.protocol = host, port, protocol
        self.engine = engine
        self._owns_engine = engine is None
        self._bases: dict[str, tuple[int, int]] = {}
        self.staging = staging if staging is not None else ReceiverStaging(bind_host=host)

    async def start(self) -> str:
        self._bases = region_bases(self.regions, "destination")
        if self.engine is None:
            self.engine = await asyncio.to_thread(MooncakeEngine, self.host, self.protocol, self.port)
        await asyncio.to_thread(self.engine.register, self._bases)
        control, area = await self.staging.start(self.regions, self.engine.register, self.admission)
        self.address = EngineAddress(
            "mooncake", self.engine.session, self._bases, control=control, staging=area
        ).encode()
        return self.address


class MooncakeLink(EngineLink):
    def __init__(self, transport: MooncakeTransport, peer: PeerEndpoint, address: EngineAddress) -> None:
        super().__init__(transport, peer, address)
        self.descriptors_per_batch = transport.max_batch_descriptors


class MooncakeTransport(Transport):
    kind = TransportKind.MOONCAKE

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        *,
        port: int = 0,
        max_batch_descriptors: int = 1024,
        recovery: Recovery | None = None,
        staging: StagingOptions | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= max_batch_descriptors <= QUEUE_LIMIT // 2:
            raise TransportError(
                f"max_batch_descriptors must be 1..{QUEUE_LIMIT // 2} (the "
                f"engine queues at most {QUEUE_LIMIT} per peer), got "
                f"{max_batch_descriptors}",
                code=Reason.INVALID_CONFIG,
            )
        self.host, self.protocol, self.port = host, protocol, port
        self.max_batch_descriptors = max_batch_descriptors
        self.recovery = recovery or Recovery()
        self.staging = staging or StagingOptions()
        self._engine: MooncakeEngine | None = None
        self._engine_lock = threading.Lock()

    def start(self) -> MooncakeEngine:
        """Start the engine now (blocking, seconds: loading it holds the GIL, so a sidecar
        does this before it serves, not on its event loop); idempotent."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = MooncakeEngine(self.host, self.protocol, self.port)
            return self._engine

    async def engine(self) -> MooncakeEngine:
        if self._engine is not None:
            return self._engine
        return await asyncio.to_thread(self.start)

    async def connect(self, peer: PeerEndpoint) -> MooncakeLink:
        """Check what the peer published and that its engine answers; raises TransportError."""
        address = EngineAddress.parse(peer.data_address, "mooncake")
        check_published(peer, address)
        engine = await self.engine()
        first = next(iter(address.regions.values()))[0]
        if not await asyncio.to_thread(engine.probe, address.session, first):
            raise TransportError(
                f"mooncake engine of {peer.peer_id} at {address.session} does not answer",
                code=Reason.TRANSPORT_FAILED,
                hint="is the decode sidecar running with transport mooncake?",
            )
        link = MooncakeLink(self, peer, address)
        await attach(
            link,
            address,
            self.staging,
            register=engine.register,
            unregister=engine.unregister,
            submit=lambda s, d, n: self._probe_write(engine, link, s, d, n),
        )
        return self._adopt(link)

    def _probe_write(
        self, engine: MooncakeEngine, link: MooncakeLink, src: list, dst: list, nbytes: list
    ) -> None:
        rc = engine.engine.batch_transfer_sync_write(link.address.session, src, dst, nbytes)
        if rc != 0:
            raise TransportError(
                f"mooncake engine failed a probe write (rc {rc})", code=Reason.TRANSPORT_FAILED
            )

    async def write(
        self, link: Link, plan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, MooncakeLink)
        link.check_usable()
        engine = await self.engine()
        return await write_parts(self, link, engine, plan, src_regions, room, generation)

    def _submit_all(
        self,
        engine: MooncakeEngine,
        link: MooncakeLink,
        parts: list,
        bases: dict,
        src: dict,
        where: str,
        room: str,
        generation: int,
    ) -> int:
        """Each part its way, in plan order (a worker thread); return the bytes written.

        Every part is bounds-checked (lowered, or cut into slot-sized chunks)
        before anything is submitted.
        """
        work = [
            (
                strategy,
                split_long(
                    lower_to_addresses(part, bases, link.dst_bases, where, dst_sizes=link.peer.region_nbytes),
                    MAX_RUN_NBYTES,
                )
                if strategy is Strategy.DIRECT
                else staged_layouts(link, part, src),
            )
            for strategy, part in parts
        ]
        written = {Strategy.DIRECT: 0, Strategy.STAGED: 0}
        with link.lock:
            link.check_usable()
            for _, todo in work:
                if isinstance(todo, AddressRuns):  # Strategy.DIRECT's, lowered
                    written[Strategy.DIRECT] += self._submit(engine, link, todo, where)
                else:
                    written[Strategy.STAGED] += run_staged(
                        link, todo, src, self._bulk(engine, link, where), room=room, generation=generation
                    )
            link.wrote(written)
            return sum(written.values())

    def _bulk(self, engine: MooncakeEngine, link: MooncakeLink, where: str):
        """One staged slot, one descriptor, submitted: the returned waiter ends it (several
        are kept in flight); an engine error settles the link as a batch's does."""

        def bulk(local: int, remote: int, nbytes: int):
            batch = engine.engine.batch_transfer_async_write(
                link.address.session, [local], [remote], [nbytes]
            )
            link.counted(1)

            def wait() -> None:
                # blocks until the batch ends (0: every byte written), and frees it
                rc = engine.engine.get_batch_transfer_status([batch]) if batch else -1
                if rc != 0:
                    first = next(iter(link.dst_bases.values()))[0]
                    recover(
                        link,
                        self.recovery,
                        lambda: engine.probe(link.address.session, first),
                        f"{where}: mooncake engine failed a staged write of {nbytes} bytes (rc {rc})",
                    )

            return wait

        return bulk

    def _submit(self, engine: MooncakeEngine, link: MooncakeLink, runs: AddressRuns, where: str) -> int:
        """Post ``runs`` batch after batch, up to ``QUEUE_LIMIT`` descriptors in flight
        (holding ``link.lock``); return the bytes written once all have ended."""
        link.check_usable()
        session, done = link.address.session, 0
        inflight: deque[tuple[int, AddressRuns]] = deque()  # (batch id, its runs)
        failed = ""
        for batch in batches(runs, self.max_batch_descriptors):
            while inflight and sum(len(b) for _, b in inflight) + len(batch) > QUEUE_LIMIT:
                failed = failed or self._ended(engine, *inflight.popleft())
            if failed:
                break
            posted = engine.engine.batch_transfer_async_write(
                session, batch.src_addr.tolist(), batch.dst_addr.tolist(), batch.nbytes.tolist()
            )
            link.counted(len(batch))
            if not posted:
                failed = "the engine refused a batch"
                break
            inflight.append((posted, batch))
            done += batch.total_nbytes
        while inflight:  # every posted batch ends before the write does, failed or not
            failed = self._ended(engine, *inflight.popleft()) or failed
        if failed:
            first = next(iter(link.dst_bases.values()))[0]
            recover(
                link,
                self.recovery,
                lambda: engine.probe(session, first),
                f"{where}: mooncake engine failed a write of {runs.total_nbytes} bytes in "
                f"{len(runs)} descriptors ({failed})",
            )
        return done

    @staticmethod
    def _ended(engine: MooncakeEngine, posted: int, batch: AddressRuns) -> str:
        """Wait for one posted batch (which frees it): "" if every byte landed, else why not."""
        rc = engine.engine.get_batch_transfer_status([posted])
        return "" if rc == 0 else f"a batch of {len(batch)} descriptors ended with rc {rc}"

    async def close(self) -> None:
        await super().close()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.close)
            self._engine = None
