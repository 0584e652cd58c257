"""Shared by test_mooncake and test_nixl: a receiver process over the parent's shm segments,
the engine's transport pinned to direct writes, and the byte-exact write check."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import pytest_asyncio

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport import PeerEndpoint
from pd_transfer.transport.engines.link import PROBE_LANDING, Recovery
from pd_transfer.transport.engines.registry import engine_unusable
from pd_transfer.transport.engines.staging.link_staging import StagingOptions
from pd_transfer.transport.engines.strategy import StrategyMode

FAST = Recovery(settle_s=0.05, probe_attempts=2, probe_backoff_s=0.05)
ORACLE_CASES = pytest.mark.parametrize(
    "case", [("llama", 2, 2), ("llama", 2, 4), ("gdn", 4, 2)], ids=["direct", "sliced", "gdn"]
)


def engine_marks(kind: str) -> list:
    """asyncio, and skipped (naming the pip extra) where the engine is not installed."""
    return [
        pytest.mark.asyncio,
        pytest.mark.skipif(bool(engine_unusable(kind)), reason=engine_unusable(kind) or "-"),
    ]


def direct_transport(kind: str, **kwargs):
    """The engine's transport pinned to the direct path (one descriptor per run);
    test_engine_staging covers staged writes and the choice between the two."""
    if kind == "mooncake":
        from pd_transfer.transport.engines.mooncake import MooncakeTransport as transport_type
    else:
        from pd_transfer.transport.engines.nixl import NixlTransport as transport_type
    kwargs.setdefault("staging", StagingOptions(mode=StrategyMode.DIRECT))
    return transport_type(**kwargs)


def receivers_fixture(kind: str):
    """A fixture starting receiver processes of ``kind`` (stopped after the test)."""

    @pytest_asyncio.fixture
    async def receivers():
        made = []

        async def start(placed: dict, agent: str = "own") -> ReceiverProcess:
            process = await ReceiverProcess(kind, placed, agent).start()
            made.append(process)
            return process

        yield start
        for process in made:
            await process.stop()

    return receivers


async def write_and_verify(transport, scenario, segments, receivers, case) -> None:
    """Every plan of the scenario through ``transport`` into a receiver process; the
    oracle then checks every destination byte."""
    sc = scenario(*case)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    peer = await receivers(placed)
    links = {rank: await transport.connect(peer.endpoint(rank)) for rank in placed}
    for plan in sc.plans:
        assert await transport.write(links[plan.dst_rank], plan, sc.src(plan), room=1) == plan.total_nbytes
    await transport.close()
    copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_receiver_child.py")


class ReceiverProcess:
    """``engine_receiver_child.py`` serving ``{rank: {region: Segment}}``; addresses by rank.
    ``agent``: which engine agent the receivers use (see the child)."""

    def __init__(self, kind: str, placed: dict, agent: str = "own") -> None:
        self.kind = kind
        self.placed = placed
        self.agent = agent
        self.proc: asyncio.subprocess.Process | None = None
        self.addresses: dict[str, str] = {}

    async def start(self) -> ReceiverProcess:
        names = {rank: {r: s.name for r, s in segs.items()} for rank, segs in self.placed.items()}
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        env.setdefault("UCX_MODULES", "^ib")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            CHILD,
            json.dumps({"kind": self.kind, "ranks": names, "agent": self.agent}),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        if not line:
            raise RuntimeError(f"{self.kind} receiver child exited with {await self.proc.wait()}")
        self.addresses = json.loads(line)
        return self

    def endpoint(self, rank: str, sizes: dict[str, int] | None = None) -> PeerEndpoint:
        sizes = sizes or {r: s.nbytes for r, s in self.placed[rank].items()}
        return PeerEndpoint.from_maps(rank, sizes, data_address=self.addresses[rank])

    async def unregister(self, rank: str, region_id: str, verb: str = "unregister") -> None:
        """Take a region (or ``"staging"``, the staging area) away from the rank's engine;
        ``verb="register"`` gives the staging area back."""
        self.proc.stdin.write(f"{verb} {rank} {region_id}\n".encode())
        await self.proc.stdin.drain()
        assert (await asyncio.wait_for(self.proc.stdout.readline(), 30)).strip() == b"ok"

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def copy_back(sc, placed: dict) -> None:
    for rank, segs in placed.items():
        for region_id, segment in segs.items():
            sc.world.decode_buffers[rank][region_id][:] = segment.array


def scattered_plan(region: str, num_runs: int, run_nbytes: int, seed: int = 0) -> TransferPlan:
    """``num_runs`` runs to distinct, non-neighbouring destination slots (nothing joins)."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(2 * num_runs)[:num_runs] * 2  # even slots only: never adjacent
    src = np.arange(num_runs, dtype=np.int64) * 2 * run_nbytes
    batch = RunBatch(
        region,
        region,
        src,
        slots.astype(np.int64) * run_nbytes,
        np.full(num_runs, run_nbytes, np.int64),
        np.ones(num_runs, np.int64),
        0,
        0,
    )
    return TransferPlan("p0", "d0", (batch,))


def expected_scatter(plan: TransferPlan, src: np.ndarray, dst_before: np.ndarray) -> np.ndarray:
    out = dst_before.copy()
    for s, d, n in zip(*plan.batches[0].byte_runs()):
        out[d : d + n] = src[s : s + n]
    return out


async def dead_peer_fails_then_refuses(transport, receivers, segments, spawn, seed: int) -> None:
    """A peer killed after connect: the write fails with peer_lost, and so does the next,
    refused at once ("failed earlier") instead of trying the dead peer again.
    ``spawn(receivers, segs)`` starts the receiver process for ``segs``."""
    plan = scattered_plan("kv", 64, 512)
    src = np.random.default_rng(seed).integers(0, 256, 2 * 64 * 512, np.uint8)
    segs = segments({"kv": np.zeros(4 * 64 * 512, np.uint8)})
    peer = await spawn(receivers, {"d0": segs})
    link = await transport.connect(peer.endpoint("d0"))
    await peer.kill()
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan, {"kv": src})
    assert info.value.code is Reason.PEER_LOST
    with pytest.raises(TransportError) as again:
        await transport.write(link, plan, {"kv": src})
    assert again.value.code is Reason.PEER_LOST and "failed earlier" in str(again.value)
    await transport.close()


async def overrun_refused_before_submission(transport, scenario, segments, receivers) -> None:
    """The peer's geometry says half of what its engine registered, so the plan overruns it:
    refused by our bounds check before any batch goes to the engine; nothing lands."""
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    placed = {plan.dst_rank: segments(sc.dst(plan))}
    peer = await receivers(placed)
    halves = {r: s.nbytes // 2 for r, s in placed[plan.dst_rank].items()}
    link = await transport.connect(peer.endpoint(plan.dst_rank, halves))
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan, sc.src(plan))
    assert info.value.code is Reason.RUN_OUT_OF_REGION and link.num_batches == 0
    assert all(np.array_equal(s.array, sc.dst(plan)[r]) for r, s in placed[plan.dst_rank].items())
    await transport.close()


async def short_engine_region_refused_at_connect(transport, segments, receivers) -> None:
    """A peer whose engine registered 4 KiB for a region its geometry says is 8 KiB."""
    segs = segments({"kv": np.zeros(4096, np.uint8)})
    peer = await receivers({"d0": segs})
    with pytest.raises(TransportError) as info:
        await transport.connect(peer.endpoint("d0", {"kv": 8192}))
    assert info.value.code is Reason.SEGMENT_TOO_SMALL
    await transport.close()


async def missing_engine_address_refused_at_connect(transport) -> None:
    """A peer that published only a plain tcp data address, none for this engine."""
    with pytest.raises(TransportError) as info:
        await transport.connect(PeerEndpoint.from_maps("d0", {"kv": 64}, data_address="tcp://127.0.0.1:1"))
    assert info.value.code is Reason.TRANSPORT_UNSUPPORTED
    await transport.close()


async def probe_lands_and_close_drops_the_engine(transport, segments, receivers, natives: Callable) -> None:
    """Connect probes the peer's first byte into PROBE_LANDING (memory no engine frees: a
    probe given up on may still land); close then drops the engine's native objects at once,
    on the closing call, with the garbage collector off. ``natives(transport)``: those objects.
    """
    region = np.zeros(4096, np.uint8)
    region[0] = 0xA5
    peer = await receivers({"d0": segments({"kv": region})})
    PROBE_LANDING[0] = 0
    await transport.connect(peer.endpoint("d0"))
    assert PROBE_LANDING[0] == 0xA5
    refs = [weakref.ref(native) for native in natives(transport)]
    assert all(ref() is not None for ref in refs)
    gc.disable()
    try:
        await transport.close()
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        gc.enable()
