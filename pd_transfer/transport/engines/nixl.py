"""NIXL transport over UCX (optional: ``pip install 'pd-transfer[nixl]'``).

Each side runs a NIXL agent with the UCX backend on CPU (DRAM) memory;
UCX picks tcp, shared memory or RDMA by itself (``UCX_TLS`` narrows it). The
writing side's agent runs without NIXL's progress thread and the receiving
side's with it (:meth:`NixlTransport.start`): with its progress thread, the
writing agent moved 16 KiB pages over UCX tcp at half the speed (1.2 vs 2.65
GB/s). The
decode side registers its regions and publishes its agent metadata with
their addresses (:class:`NixlReceiver`); the prefill side loads that
metadata (``add_remote_agent``) at connect, so only decode -> prefill
metadata travels, inside the registration. ::

    receiver = NixlReceiver(decode_regions)       # decode
    await receiver.start()                        # 'nixl://pdt-recv-.../...'
    transport = NixlTransport()                   # prefill
    link = await transport.connect(PeerEndpoint.from_maps(rank, sizes, data_address=address))
    await transport.write(link, plan, prefill_regions)

Each write is one prepared WRITE request: both sides' pools prepared once as rows
(:mod:`~pd_transfer.transport.engines.nixl_prepared`), kept on the link.

Plans of small runs go staged instead where the peer offers a staging area
(:mod:`~pd_transfer.transport.engines.staging.link_staging`): gathered into 4 MiB slots, one descriptor each,
scattered by decode. The agent itself (loading NIXL, UCX settings,
registration, the receiver) lives in :mod:`~pd_transfer.transport.engines.nixl_agent`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind
from pd_transfer.transport.copy.bounds import check_bounds
from pd_transfer.transport.copy.runs import expand, flatten, row_nbytes_for
from pd_transfer.transport.engines.address import EngineAddress
from pd_transfer.transport.engines.link import EngineLink, Recovery, check_published, recover
from pd_transfer.transport.engines.nixl_agent import NixlEngine, NixlReceiver, load_api
from pd_transfer.transport.engines.nixl_prepared import (
    MAX_PREPARED_LISTS,
    MAX_ROW_NBYTES,
    Prepared,
    cached,
    drop,
    prepare,
    prepped_write,
)
from pd_transfer.transport.engines.runs import lower_to_addresses
from pd_transfer.transport.engines.staging.link_staging import (
    StagingOptions,
    attach,
    run_staged,
    staged_layouts,
    write_parts,
)
from pd_transfer.transport.engines.strategy import Strategy
from pd_transfer.transport.regions import Regions

__all__ = ["MAX_PREPARED_LISTS", "NixlEngine", "NixlLink", "NixlReceiver", "NixlTransport", "load_api"]


class NixlLink(EngineLink):
    transport: NixlTransport

    def __init__(self, transport: NixlTransport, peer: PeerEndpoint, address: EngineAddress) -> None:
        super().__init__(transport, peer, address)
        self.remote = address.session
        # row_nbytes -> the peer's pools as rows; (row_nbytes, our source pools) -> ours
        self.prepared: OrderedDict[int, Prepared | None] = OrderedDict()
        self.local: OrderedDict[tuple, Prepared | None] = OrderedDict()

    async def _release(self) -> None:
        lists = [*self.prepared.values(), *self.local.values()]
        self.prepared, self.local = OrderedDict(), OrderedDict()
        for prepared in lists:  # before the peer's metadata goes: its lists refer to it
            drop(prepared)
        engine = self.transport._engine
        if engine is not None:
            try:
                engine.agent.remove_remote_agent(self.remote)
            except Exception:  # already gone with the peer: nothing left to free
                pass
        await super()._release()


class NixlTransport(Transport):
    kind = TransportKind.NIXL

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        error_handling_mode: str = "none",
        timeout_s: float = 60.0,
        max_prepared_rows: int = 1 << 21,
        recovery: Recovery | None = None,
        staging: StagingOptions | None = None,
        ucx_threads: int = 1,
    ) -> None:
        super().__init__()
        self.staging = staging or StagingOptions()
        self.host = host  # both agents' UCX listeners: the device holding it (NixlEngine)
        self.error_handling_mode = error_handling_mode
        self.timeout_s = timeout_s
        self.max_prepared_rows = max_prepared_rows
        self.ucx_threads = ucx_threads  # the writing agent's (:meth:`start`)
        self.recovery = recovery or Recovery()
        self._engine: NixlEngine | None = None  # initiating: writes, no progress thread
        self._target: NixlEngine | None = None  # receiving: the peers' writes land here
        self._engine_lock = threading.Lock()

    def start(self) -> NixlEngine:
        """Start this process's two agents now (blocking, seconds: loading NIXL and UCX holds
        the GIL, so a sidecar does this before it serves, not on its event loop); idempotent.

        Returns the initiating agent, which every write of this transport goes through: it
        runs without a progress thread, its UCX worker progressed by the writer's own polls
        of transfer state (:meth:`NixlEngine.wait`, which also ends a stalled write at its
        deadline). The receiving agent (:meth:`receiving_engine`) keeps its progress thread:
        a passive target calls nothing that would progress it.
        """
        return self._agents()[0]

    def _agents(self) -> tuple[NixlEngine, NixlEngine]:
        """(initiating, receiving), each started once."""
        with self._engine_lock:
            if self._engine is None:
                self._engine = NixlEngine(
                    "side",
                    self.error_handling_mode,
                    progress_thread=False,
                    host=self.host,
                    ucx_threads=self.ucx_threads,
                )
            if self._target is None:
                self._target = NixlEngine("recv", self.error_handling_mode, host=self.host)
            return self._engine, self._target

    def engine(self) -> NixlEngine:
        return self._engine or self.start()

    def receiving_engine(self) -> NixlEngine:
        """The agent a :class:`NixlReceiver` of this process shares (see :meth:`start`)."""
        return self._agents()[1]

    async def connect(self, peer: PeerEndpoint) -> NixlLink:
        address = EngineAddress.parse(peer.data_address, "nixl")
        check_published(peer, address)
        engine = await asyncio.to_thread(self.engine)
        try:
            name = await asyncio.to_thread(engine.agent.add_remote_agent, address.metadata)
        except Exception as err:
            raise TransportError(
                f"nixl metadata of {peer.peer_id} does not load: {err}", code=Reason.BAD_FIELD
            ) from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != address.session:
            raise TransportError(
                f"nixl metadata of {peer.peer_id} names agent {name!r}, its address {address.session!r}",
                code=Reason.BAD_FIELD,
            )
        first = next(iter(address.regions.values()))[0]
        if not await asyncio.to_thread(engine.probe, name, first):
            raise TransportError(
                f"nixl agent {name} of {peer.peer_id} does not answer", code=Reason.TRANSPORT_FAILED
            )
        link = NixlLink(self, peer, address)
        await attach(
            link,
            address,
            self.staging,
            register=engine.register,
            unregister=engine.unregister,
            submit=lambda s, d, n: self._probe_write(engine, link, s, d, n),
        )
        return self._adopt(link)

    def _probe_write(self, engine: NixlEngine, link: NixlLink, src: list, dst: list, nbytes: list) -> None:
        state = self._write_descs(engine, link, src, dst, nbytes)
        if state != "DONE":
            raise TransportError(f"nixl probe write ended {state.lower()}", code=Reason.TRANSPORT_FAILED)

    def _write_descs(self, engine: NixlEngine, link: NixlLink, src: list, dst: list, nbytes: list) -> str:
        return engine.run(
            self._descs_request(engine, link, src, dst, nbytes), time.monotonic() + self.timeout_s
        )

    @staticmethod
    def _descs_request(engine: NixlEngine, link: NixlLink, src: list, dst: list, nbytes: list):
        lengths = np.array(nbytes, np.int64)
        try:
            return engine.agent.initialize_xfer(
                "WRITE",
                engine.descs(np.array(src, np.uint64), lengths),
                engine.descs(np.array(dst, np.uint64), lengths),
                link.remote,
            )
        except Exception as err:
            raise TransportError(
                f"nixl refused a staged write: {err}", code=Reason.TRANSPORT_FAILED
            ) from None

    async def write(
        self, link: Link, plan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, NixlLink)
        link.check_usable()
        engine = self.engine()
        return await write_parts(self, link, engine, plan, src_regions, room, generation)

    def _submit_all(
        self,
        engine: NixlEngine,
        link: NixlLink,
        parts: list,
        bases: dict,
        src: dict,
        where: str,
        room: str,
        generation: int,
    ) -> int:
        """Each part its way, in plan order (a worker thread); return the bytes written.

        Every part is bounds-checked before anything is submitted (a lone
        direct part by :meth:`_request` itself).
        """
        work = [
            (
                strategy,
                self._checked(link, part, bases, where, alone=len(parts) == 1)
                if strategy is Strategy.DIRECT
                else staged_layouts(link, part, src),
            )
            for strategy, part in parts
        ]
        written = {Strategy.DIRECT: 0, Strategy.STAGED: 0}
        with link.lock:
            link.check_usable()
            for strategy, todo in work:
                if strategy is Strategy.DIRECT:
                    written[strategy] += self._submit(engine, link, todo, bases, where)
                else:
                    written[strategy] += run_staged(
                        link, todo, src, self._bulk(engine, link, where), room=room, generation=generation
                    )
            link.wrote(written)
            return sum(written.values())

    @staticmethod
    def _checked(link: NixlLink, part, bases: dict, where: str, *, alone: bool):
        if not alone:
            check_bounds(flatten(part), {r: n for r, (_, n) in bases.items()}, _dst_sizes(link), where)
        return part

    def _submit(self, engine: NixlEngine, link: NixlLink, plan, bases: dict, where: str) -> int:
        """Build the request (prepared rows, or direct descriptors) and run it (holding the lock)."""
        handle, total = self._request(engine, link, plan, bases, where)
        if handle is None:
            return 0
        link.counted(1)
        state = engine.run(handle, time.monotonic() + self.timeout_s)
        self._finish(engine, link, state, f"{where}: nixl transfer of {total} bytes")
        return total

    def _bulk(self, engine: NixlEngine, link: NixlLink, where: str):
        """One staged slot, one descriptor, posted: the returned waiter ends it (several are
        kept in flight); an engine error settles the link as a request's does."""

        def bulk(local: int, remote: int, nbytes: int):
            link.counted(1)
            handle = self._descs_request(engine, link, [local], [remote], [nbytes])
            deadline_s = time.monotonic() + self.timeout_s
            state = engine.post(handle)

            def wait() -> None:
                self._finish(
                    engine,
                    link,
                    engine.wait(handle, state, deadline_s),
                    f"{where}: nixl staged write of {nbytes} bytes",
                )

            return wait

        return bulk

    def _finish(self, engine: NixlEngine, link: NixlLink, state: str, what: str) -> None:
        """Return if ``state`` is DONE; otherwise fail the write (and settle or fail the link)."""
        if state == "DONE":
            return
        what = f"{what} ended {state.lower()}"
        if state == "TIMEOUT":
            link.failed = TransportError(f"{what} after {self.timeout_s} s", code=Reason.TIMEOUT)
            raise link.failed
        first = next(iter(link.dst_bases.values()))[0]
        recover(link, self.recovery, lambda: engine.probe(link.remote, first), what)

    def _request(self, engine: NixlEngine, link: NixlLink, plan, bases: dict, where: str):
        flat = flatten(plan)
        dst_sizes = _dst_sizes(link)
        check_bounds(flat, {r: n for r, (_, n) in bases.items()}, dst_sizes, where)
        runs = expand(flat)
        if not len(runs):
            return None, 0
        total = int(runs.nbytes.sum())
        row = row_nbytes_for(runs.src_offset, runs.dst_offset, runs.nbytes, cap=MAX_ROW_NBYTES)
        try:
            key = (row, tuple(sorted(bases.items())))
            local = cached(link.local, key, lambda: self._prepare(engine, "NIXL_INIT_AGENT", bases, row))
            remote = cached(
                link.prepared, row, lambda: self._prepare(engine, link.remote, link.dst_bases, row)
            )
            if local is None or remote is None:  # too many rows to prepare: describe the runs
                direct = lower_to_addresses(plan, bases, link.dst_bases, where, dst_sizes=dst_sizes)
                return engine.agent.initialize_xfer(
                    "WRITE",
                    engine.descs(direct.src_addr, direct.nbytes),
                    engine.descs(direct.dst_addr, direct.nbytes),
                    link.remote,
                ), total
            return prepped_write(engine, flat, runs, row, local, remote), total
        except Exception as err:
            raise TransportError(
                f"{where}: nixl refused the request: {err}", code=Reason.TRANSPORT_FAILED
            ) from None

    def _prepare(self, engine: NixlEngine, agent: str, bases: dict, row: int) -> Prepared | None:
        return prepare(engine, agent, bases, row, self.max_prepared_rows)

    async def close(self) -> None:
        await super().close()
        engine, self._engine = self._engine, None
        target, self._target = self._target, None
        if engine is not None:
            await asyncio.to_thread(engine.close)
        if target is not None:
            await asyncio.to_thread(target.close)


def _dst_sizes(link: NixlLink) -> dict[str, int]:
    """Each destination region's size: the smaller of what the engine and the geometry say."""
    return {r: min(n, link.peer.region_nbytes.get(r, n)) for r, (_, n) in link.dst_bases.items()}
