"""Staged writes through the real engines (Mooncake, NIXL) into a receiver process.

Each case runs for every engine installed here and is skipped, naming the pip
extra, elsewhere. The receiver child publishes a staging area of 16 slots of
4 MiB with its engine address; the transport gathers, writes each slot with
one engine descriptor and waits for decode's scatter acknowledgement.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio
from engine_harness import (
    ReceiverProcess,
    copy_back,
    dead_peer_fails_then_refuses,
    expected_scatter,
    scattered_plan,
)

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.engines.link import Recovery
from pd_transfer.transport.engines.registry import ENGINES, engine_unusable
from pd_transfer.transport.engines.staging.link_staging import StagingOptions
from pd_transfer.transport.engines.strategy import Strategy, StrategyMode

pytestmark = pytest.mark.asyncio
FAST = Recovery(settle_s=0.05, probe_attempts=2, probe_backoff_s=0.05)
KINDS = [
    pytest.param(e, marks=pytest.mark.skipif(bool(engine_unusable(e)), reason=engine_unusable(e) or "-"))
    for e in ENGINES
]


def _transport(kind: str, mode: StrategyMode = StrategyMode.STAGED, **kwargs):
    options = StagingOptions(mode=mode)
    if kind == "mooncake":
        from pd_transfer.transport.engines.mooncake import MooncakeTransport

        return MooncakeTransport(staging=options, **kwargs)
    from pd_transfer.transport.engines.nixl import NixlTransport

    return NixlTransport(staging=options, **kwargs)


@pytest_asyncio.fixture
async def receivers():
    made = []

    async def start(kind: str, placed: dict) -> ReceiverProcess:
        process = await ReceiverProcess(kind, placed).start()
        made.append(process)
        return process

    yield start
    for process in made:
        await process.stop()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "case", [("llama", 2, 2), ("llama", 2, 4), ("gdn", 4, 2)], ids=["direct", "sliced", "gdn"]
)
async def test_staged_writes_land_exactly_the_oracle_bytes(scenario, segments, receivers, kind, case):
    sc = scenario(*case)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    peer = await receivers(kind, placed)
    transport = _transport(kind)
    links = {rank: await transport.connect(peer.endpoint(rank)) for rank in placed}
    assert all(link.staging is not None for link in links.values())
    for plan in sc.plans:
        link = links[plan.dst_rank]
        assert await transport.write(link, plan, sc.src(plan), room=1) == plan.total_nbytes
        assert link.last_strategies == {Strategy.STAGED}
    await transport.close()
    copy_back(sc, placed)
    assert sc.world.verify(sc.requests) == []


@pytest.mark.parametrize("kind", KINDS)
async def test_auto_splits_a_plan_at_the_links_crossover(segments, receivers, kind):
    # one batch of 2 KiB runs, one of 64 KiB runs; the crossover pinned at 16 KiB
    small, large = scattered_plan("a", 512, 2048), scattered_plan("b", 32, 65536, seed=1)
    plan = TransferPlan("p0", "d0", small.batches + large.batches)
    src = {
        "a": np.random.default_rng(2).integers(0, 256, 2 * 512 * 2048, np.uint8),
        "b": np.random.default_rng(3).integers(0, 256, 2 * 32 * 65536, np.uint8),
    }
    segs = segments({"a": np.zeros(4 * 512 * 2048, np.uint8), "b": np.zeros(4 * 32 * 65536, np.uint8)})
    peer = await receivers(kind, {"d0": segs})
    transport = _transport(kind, StrategyMode.AUTO)
    link = await transport.connect(peer.endpoint("d0"))
    assert link.staging.cost is not None
    link.staging.crossover_nbytes = 16384
    assert await transport.write(link, plan, src) == plan.total_nbytes
    assert link.last_strategies == {Strategy.DIRECT, Strategy.STAGED}
    assert link.nbytes_by_strategy == {Strategy.STAGED: 512 * 2048, Strategy.DIRECT: 32 * 65536}
    for region, part in (("a", small), ("b", large)):
        zeros = np.zeros(segs[region].nbytes, np.uint8)
        assert np.array_equal(segs[region].array, expected_scatter(part, src[region], zeros))
    link.set_strategy(["a", "b"], Strategy.DIRECT)  # the agent's per-pool choice wins
    assert await transport.write(link, plan, src) == plan.total_nbytes
    assert link.last_strategies == {Strategy.DIRECT}
    await transport.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_staged_run_outside_the_region_is_refused_by_decode(segments, receivers, kind):
    plan = scattered_plan("kv", 64, 512)
    src = np.random.default_rng(4).integers(0, 256, 2 * 64 * 512, np.uint8)
    segs = segments({"kv": np.zeros(4 * 64 * 512, np.uint8)})
    peer = await receivers(kind, {"d0": segs})
    transport = _transport(kind)
    link = await transport.connect(peer.endpoint("d0"))
    # past our own check (we believe the region is 8x larger): decode's check refuses
    address, nbytes = link.dst_bases["kv"]
    link.dst_bases["kv"] = (address, 8 * nbytes)
    far = TransferPlan(
        "p0",
        "d0",
        (
            RunBatch(
                "kv", "kv", np.array([0]), np.array([5 * nbytes]), np.array([512]), np.ones(1, np.int64), 0, 0
            ),
        ),
    )
    bigger = type(link.peer).from_maps("d0", {"kv": 8 * nbytes}, data_address=link.peer.data_address)
    link.peer = bigger
    with pytest.raises(TransportError) as info:
        await transport.write(link, TransferPlan("p0", "d0", plan.batches + far.batches), {"kv": src})
    assert info.value.code is Reason.RUN_OUT_OF_REGION and "refused" in str(info.value)
    assert not segs["kv"].array.any()  # nothing of the chunk was scattered
    # the link and its staging channel stay usable
    assert await transport.write(link, plan, {"kv": src}) == 64 * 512
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, np.zeros(4 * 64 * 512, np.uint8)))
    await transport.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_many_staged_writes_reuse_a_bounded_ring(segments, receivers, kind):
    # 4,096 runs of 2 KiB = 8 MiB, three slots' worth of chunks, written 6 times; a
    # fifth link finds the decode area (16 slots, 4 a ring) leased out and goes direct
    plan = scattered_plan("kv", 4096, 2048)
    src = np.random.default_rng(5).integers(0, 256, 2 * 4096 * 2048, np.uint8)
    before = np.random.default_rng(6).integers(0, 256, 4 * 4096 * 2048, np.uint8)
    segs = segments({"kv": before})
    peer = await receivers(kind, {"d0": segs})
    transport = _transport(kind)
    links = [await transport.connect(peer.endpoint("d0")) for _ in range(5)]
    assert [link.staging is None for link in links] == [False] * 4 + [True]
    link = links[0]
    for _ in range(6):
        assert await transport.write(link, plan, {"kv": src}) == 4096 * 2048
    assert len(link.staging.channel.slots) == 4
    assert link.last_strategies == {Strategy.STAGED}
    assert await transport.write(links[4], plan, {"kv": src}) == 4096 * 2048
    assert links[4].last_strategies == {Strategy.DIRECT}
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, before))
    await transport.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_direct_mode_opens_no_staging_channel(segments, receivers, kind):
    segs = segments({"kv": np.zeros(4 * 64 * 512, np.uint8)})
    peer = await receivers(kind, {"d0": segs})
    transport = _transport(kind, StrategyMode.DIRECT)
    link = await transport.connect(peer.endpoint("d0"))
    assert link.staging is None
    plan = scattered_plan("kv", 64, 512)
    assert await transport.write(link, plan, {"kv": np.ones(2 * 64 * 512, np.uint8)}) == 64 * 512
    assert link.last_strategies == {Strategy.DIRECT}
    await transport.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_dead_peer_fails_a_staged_write_and_the_link_is_then_refused(segments, receivers, kind):
    await dead_peer_fails_then_refuses(
        _transport(kind, recovery=FAST), receivers, segments, lambda spawn, segs: spawn(kind, segs), seed=7
    )


@pytest.mark.parametrize("kind", KINDS)
async def test_an_engine_error_on_a_staged_write_leaves_no_stuck_peer(segments, receivers, kind):
    plan = scattered_plan("kv", 4096, 2048)  # three slots' worth: chunks are in flight
    src = np.random.default_rng(8).integers(0, 256, 2 * 4096 * 2048, np.uint8)
    segs = segments({"kv": np.zeros(4 * 4096 * 2048, np.uint8)})
    peer = await receivers(kind, {"d0": segs})
    transport = _transport(kind, recovery=FAST)
    link = await transport.connect(peer.endpoint("d0"))
    channel = link.staging.channel
    if kind == "mooncake":  # the peer's engine refuses writes into its staging area
        await peer.unregister("d0", "staging")
    else:  # past the area NIXL knows: it refuses the request
        channel.remote_base += 1 << 30
    with pytest.raises(TransportError) as info:
        await transport.write(link, plan, {"kv": src})
    assert info.value.code is Reason.TRANSPORT_FAILED and link.failed is None
    assert channel.broken is None  # every answer due was read: the stream is in step
    if kind == "mooncake":
        await peer.unregister("d0", "staging", verb="register")
    else:
        channel.remote_base -= 1 << 30
    assert await transport.write(link, plan, {"kv": src}) == 4096 * 2048
    assert np.array_equal(segs["kv"].array, expected_scatter(plan, src, np.zeros(4 * 4096 * 2048, np.uint8)))
    await transport.close()
