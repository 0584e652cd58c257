"""Staged writes without an engine: gather, a memmove standing in for the engine, decode scatters.

The staging protocol (:mod:`pd_transfer.transport.engines.staging.sender`, ``staging_receiver``)
runs here in one process: the "engine" copies a local ring slot into the
decode staging area with ``ctypes.memmove``, exactly what Mooncake or NIXL do
across processes. Byte-exactness, the decode-side checks, the bounded ring
and authentication are checked against it; test_engine_staging runs the same
path through the real engines.
"""

from __future__ import annotations

import asyncio
import ctypes
import time

import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport.copy.packing import layout_chunks
from pd_transfer.transport.engines.probe import measure_path
from pd_transfer.transport.engines.staging.receiver import StagingArea, StagingReceiver
from pd_transfer.transport.engines.staging.sender import open_channel, write_staged
from pd_transfer.transport.engines.strategy import RunProfile, Strategy, choose
from pd_transfer.transport.regions import map_regions
from pd_transfer.transport.tcp.frames import Fail, decode_reply
from pd_transfer.transport.tcp.sockets import Kind, read_prefix, recv_exact, send_frame

pytestmark = pytest.mark.asyncio
SLOT = 64 << 10


def _memmove(local: int, remote: int, nbytes: int) -> None:
    ctypes.memmove(remote, local, nbytes)


def _submit(src: list, dst: list, nbytes: list) -> None:
    for s, d, n in zip(src, dst, nbytes):
        ctypes.memmove(d, s, n)


class Decode:
    """A StagingReceiver over ``regions`` with an area of ``num_slots`` slots."""

    def __init__(self, regions: dict, num_slots: int = 8, auth=None) -> None:
        self.area = StagingArea(num_slots, SLOT)
        self.receiver = StagingReceiver(regions, self.area, auth=auth)

    async def __aenter__(self) -> Decode:
        await self.receiver.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.receiver.stop()

    async def channel(self, ring_slots: int = 4, auth=None):
        return await asyncio.to_thread(
            open_channel,
            self.receiver.address,
            self.area.published,
            "d0",
            ring_slots=ring_slots,
            auth=auth,
            timeout_s=30,
        )


async def _write(channel, plan, src_regions: dict, dst_sizes: dict | None = None, **kw) -> int:
    src = map_regions(src_regions, (b.src_region for b in plan.batches), "source")
    layouts = layout_chunks(
        plan, {r: m.nbytes for r, m in src.items()}, channel.slot_nbytes, dst_sizes=dst_sizes
    )
    return await asyncio.to_thread(write_staged, channel, layouts, src, _memmove, **kw)


@pytest.mark.parametrize(
    "case", [("llama", 2, 2), ("llama", 2, 4), ("gdn", 4, 2)], ids=["direct", "sliced", "gdn"]
)
async def test_staged_writes_land_exactly_the_oracle_bytes(scenario, case):
    sc = scenario(*case)
    decodes = {rank: Decode(regions) for rank, regions in sc.world.decode_buffers.items()}
    for decode in decodes.values():
        await decode.__aenter__()
    try:
        channels = {rank: await d.channel() for rank, d in decodes.items()}
        for plan in sc.plans:
            assert await _write(channels[plan.dst_rank], plan, sc.src(plan), room="r") == plan.total_nbytes
        for channel in channels.values():
            channel.close()
    finally:
        for decode in decodes.values():
            await decode.__aexit__()
    assert sc.world.verify(sc.requests) == []
    landed = sum(d.receiver.stats.nbytes_landed for d in decodes.values())
    assert landed == sum(p.total_nbytes for p in sc.plans)


class _Posted:
    """A bulk that posts: the bytes move only when its waiter runs (as an asynchronous
    engine's may, any time before), so a chunk announced before its wait would scatter
    the slot's old bytes. Counts the writes in flight at once."""

    def __init__(self) -> None:
        self.in_flight = self.most_in_flight = 0

    def __call__(self, local: int, remote: int, nbytes: int):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)

        def wait() -> None:
            time.sleep(0.002)  # long enough for decode to scatter a chunk announced early
            ctypes.memmove(remote, local, nbytes)
            self.in_flight -= 1

        return wait


async def test_posted_writes_overlap_and_every_chunk_is_announced_after_its_write(scenario):
    sc = scenario("llama", 2, 4)
    bulk = _Posted()
    decodes = {rank: Decode(regions) for rank, regions in sc.world.decode_buffers.items()}
    for decode in decodes.values():
        await decode.__aenter__()
    try:
        for plan in sc.plans:
            channel = await decodes[plan.dst_rank].channel(ring_slots=4)
            src = map_regions(sc.src(plan), (b.src_region for b in plan.batches), "source")
            # small chunks: many per plan, so the ring turns over several times
            layouts = layout_chunks(plan, {r: m.nbytes for r, m in src.items()}, 4096)
            assert (
                await asyncio.to_thread(write_staged, channel, layouts, src, bulk, room="r")
                == plan.total_nbytes
            )
            channel.close()
    finally:
        for decode in decodes.values():
            await decode.__aexit__()
    assert sc.world.verify(sc.requests) == []
    # half the ring of 4 kept in flight, plus the write just posted; all waited for
    assert bulk.most_in_flight == 3 and bulk.in_flight == 0


def _plan(runs: list[tuple[int, int, int]], region: str = "kv") -> TransferPlan:
    src, dst, n = (np.array(c, np.int64) for c in zip(*runs))
    return TransferPlan("p0", "d0", (RunBatch(region, region, src, dst, n, np.ones(len(n), np.int64), 0, 0),))


async def test_a_run_outside_the_region_is_refused_before_any_byte_is_scattered():
    dst = np.zeros(4096, np.uint8)
    src = np.arange(8192, dtype=np.int64).astype(np.uint8)
    # the first run fits, the second ends 16 bytes past the 4 KiB region
    plan = _plan([(0, 0, 1024), (1024, 3088, 1024)])
    async with Decode({"kv": dst}) as decode:
        channel = await decode.channel()
        with pytest.raises(TransportError) as info:
            await _write(channel, plan, {"kv": src})  # no sender-side check: decode's own
        assert info.value.code is Reason.RUN_OUT_OF_REGION and "refused" in str(info.value)
        assert not dst.any()
        assert decode.receiver.stats.refused[Reason.RUN_OUT_OF_REGION] == 1
        # the channel is still in step: the next write lands
        assert await _write(channel, _plan([(0, 0, 1024)]), {"kv": src}) == 1024
        assert np.array_equal(dst[:1024], src[:1024])
        channel.close()


async def test_a_refused_chunk_stops_the_write_and_every_answer_still_due_is_read():
    dst = np.zeros(16 * SLOT, np.uint8)
    src = np.random.default_rng(0).integers(0, 256, 16 * SLOT, np.uint8)
    # six slot-sized chunks; the fourth run is outside a region decode does not have
    good = [(k * SLOT, k * SLOT, SLOT) for k in range(6)]
    plan = TransferPlan(
        "p0",
        "d0",
        (
            RunBatch(
                "kv", "kv", *(np.array(c, np.int64) for c in zip(*good[:3])), np.ones(3, np.int64), 0, 0
            ),
            RunBatch(
                "kv",
                "nope",
                np.array([3 * SLOT]),
                np.array([0]),
                np.array([SLOT]),
                np.ones(1, np.int64),
                0,
                0,
            ),
            RunBatch(
                "kv", "kv", *(np.array(c, np.int64) for c in zip(*good[4:])), np.ones(2, np.int64), 0, 0
            ),
        ),
    )
    async with Decode({"kv": dst}) as decode:
        channel = await decode.channel(ring_slots=2)
        with pytest.raises(TransportError) as info:
            await _write(channel, plan, {"kv": src})
        assert info.value.code is Reason.UNKNOWN_REGION
        assert np.array_equal(dst[: 3 * SLOT], src[: 3 * SLOT]) and not dst[3 * SLOT :].any()
        assert await _write(channel, _plan([(0, 5 * SLOT, 100)]), {"kv": src}) == 100
        channel.close()


async def test_rings_are_bounded_by_the_area_and_come_back_when_a_peer_leaves():
    dst = np.zeros(8 * SLOT, np.uint8)
    src = np.random.default_rng(1).integers(0, 256, 8 * SLOT, np.uint8)
    # 40 runs of 4 KiB, each chunk a slot of 16 runs: 3 chunks a write, 10 writes
    plan = _plan([(k * 8192, k * 4096, 4096) for k in range(40)])
    async with Decode({"kv": dst}, num_slots=6) as decode:
        first = await decode.channel(ring_slots=4)
        second = await decode.channel(ring_slots=4)
        assert (len(first.slots), len(second.slots)) == (4, 2)
        assert await decode.channel() is None  # the area is leased out
        for _ in range(10):  # many writes reuse the same slots
            assert await _write(second, plan, {"kv": src}) == 40 * 4096
        assert decode.area.num_free == 0
        first.close()
        third = await _until(decode)
        assert len(third.slots) == 4
        for channel in (second, third):
            channel.close()
    expected = src.reshape(-1, 4096)[0:80:2].ravel()
    assert np.array_equal(dst[: 40 * 4096], expected)


async def _until(decode: Decode):
    """A channel once the closed peer's ring is back (its thread notices the close)."""
    for _ in range(500):
        channel = await decode.channel()
        if channel is not None:
            return channel
        await asyncio.sleep(0.01)
    raise AssertionError("the ring of a closed channel never came back")


async def test_a_slot_outside_the_connections_ring_is_refused():
    dst = np.zeros(4096, np.uint8)
    async with Decode({"kv": dst}, num_slots=4) as decode:
        channel = await decode.channel(ring_slots=1)
        channel.slots = (3,)  # pretend decode granted slot 3 (it granted 0)
        with pytest.raises(TransportError) as info:
            await _write(channel, _plan([(0, 0, 64)]), {"kv": np.ones(64, np.uint8)})
        assert info.value.code is Reason.RUN_OUT_OF_REGION and "slot 3" in str(info.value)
        assert not dst.any()
        channel.close()


async def test_the_probe_measures_every_cost_on_the_path():
    async with Decode({"kv": np.zeros(4096, np.uint8)}) as decode:
        channel = await decode.channel()
        cost = await asyncio.to_thread(measure_path, channel, _submit, repeats=1)
        channel.close()
    assert cost.engine_bytes_per_s > 0 and cost.copy_bytes_per_s > 0
    assert min(cost.fixed_s, cost.per_descriptor_s, cost.copy_per_run_s, cost.round_trip_s) >= 0
    assert decode.receiver.stats.refused == {}


def _engine_like(per_tiny_s: float, per_run_s: float, bytes_per_s: float):
    """A submit that takes the time an engine would and moves nothing: ``per_tiny_s`` for
    each descriptor of 64 B or less beyond the first, ``per_run_s`` for each larger one,
    the bytes at ``bytes_per_s``."""

    def submit(src: list, dst: list, nbytes: list) -> None:
        extra = [per_tiny_s if n <= 64 else per_run_s for n in nbytes[1:]]
        time.sleep(sum(extra) + sum(nbytes) / bytes_per_s)

    return submit


@pytest.mark.parametrize(
    "per_tiny_s, per_run_s, floor_s",
    [
        # Mooncake tcp-like: runs of 4 KiB go out in parallel, and 256 of them take no longer
        # than their bytes as one run; each descriptor still costs tens of us
        (40e-6, 0.0, 20e-6),
        # NIXL UCX-like: a tiny descriptor costs next to nothing, a run of a few KiB does
        (0.5e-6, 60e-6, 20e-6),
    ],
)
async def test_the_probe_prices_a_descriptor_by_whichever_way_shows_its_cost(per_tiny_s, per_run_s, floor_s):
    async with Decode({"kv": np.zeros(4096, np.uint8)}) as decode:
        channel = await decode.channel()
        cost = await asyncio.to_thread(
            measure_path, channel, _engine_like(per_tiny_s, per_run_s, 0.2e9), repeats=3
        )
        channel.close()
    assert cost.per_descriptor_s >= floor_s, cost.describe()
    # so 512-byte head slices are staged (over Mooncake they went direct at 7 s a request)
    assert (
        choose(
            RunProfile.of(np.full(1024, 512)), cost, slot_nbytes=SLOT, batch_descriptors=2048, ring_slots=4
        ).strategy
        is Strategy.STAGED
    )


class TokenAuth:
    """A stand-in for the agent's HMAC handshake: the client sends a token, the server checks it."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.refused = 0

    def client(self, channel, peer: str) -> None:
        channel.send(self.token)

    def server(self, first_frame: bytes, channel, where: str) -> str:
        if first_frame != self.token:
            self.refused += 1
            raise TransportError("wrong token", code=Reason.AUTH_FAILED)
        return "prefill-0"

    def unauthenticated(self, where: str) -> None:
        self.refused += 1


async def test_the_control_channel_runs_the_handshake_before_anything_else():
    auth = TokenAuth(b"s3cret")
    dst = np.zeros(4096, np.uint8)
    async with Decode({"kv": dst}, auth=auth) as decode:
        with pytest.raises(TransportError) as info:
            await decode.channel()  # no handshake at all
        assert info.value.code is Reason.UNAUTHENTICATED
        with pytest.raises(TransportError):
            await decode.channel(auth=TokenAuth(b"guess"))
        assert auth.refused == 2 and decode.area.num_free == 8
        channel = await decode.channel(auth=auth)
        assert await _write(channel, _plan([(0, 8, 64)]), {"kv": np.ones(64, np.uint8)}) == 64
        assert dst[8:72].all() and not dst[:8].any()
        channel.close()


async def test_a_garbled_request_is_answered_and_refused():
    async with Decode({"kv": np.zeros(4096, np.uint8)}) as decode:
        channel = await decode.channel()
        await asyncio.to_thread(send_frame, channel.sock, Kind.DATA, b"\x93not a map")
        head = await asyncio.to_thread(
            read_prefix, channel.sock, max_header_nbytes=4096, max_payload_nbytes=0
        )
        raw = await asyncio.to_thread(recv_exact, channel.sock, head.header_nbytes)
        reply = decode_reply(raw)
        assert head.kind is Kind.REPLY and isinstance(reply, Fail) and reply.code == "bad_frame"
        assert decode.receiver.stats.refused[Reason.BAD_FRAME] == 1
        channel.close()


async def test_a_plan_is_cut_into_parts_written_in_plan_order():
    from types import SimpleNamespace

    from pd_transfer.transport.engines.staging.link_staging import LinkStaging, segments
    from pd_transfer.transport.engines.strategy import Strategy, StrategyMode

    def batch(region: str, run_nbytes: int) -> RunBatch:
        n = np.full(4, run_nbytes, np.int64)
        return RunBatch(
            region,
            region,
            np.arange(4, dtype=np.int64) * 2 * run_nbytes,
            np.arange(4, dtype=np.int64) * 2 * run_nbytes,
            n,
            np.ones(4, np.int64),
            0,
            0,
        )

    # small KV runs stage (crossover 8 KiB), a big block goes direct, and the aux row
    # (set direct by the agent) stays last: its arrival means everything before landed
    plan = TransferPlan(
        "p0", "d0", (batch("kv", 512), batch("kv", 1 << 20), batch("kv", 512), batch("aux", 64))
    )
    staging = LinkStaging(None, None, 8192, unregister=lambda _: None, by_region={"aux": Strategy.DIRECT})
    link = SimpleNamespace(staging=staging)
    parts = segments(plan, link, StrategyMode.AUTO)
    assert [(s, [int(b.nbytes[0]) for b in p.batches]) for s, p in parts] == [
        (Strategy.STAGED, [512]),
        (Strategy.DIRECT, [1 << 20]),
        (Strategy.STAGED, [512]),
        (Strategy.DIRECT, [64]),
    ]
    assert [p.batches for _, p in segments(plan, link, StrategyMode.STAGED)] == [plan.batches]
    assert segments(plan, SimpleNamespace(staging=None), StrategyMode.AUTO) == [(Strategy.DIRECT, plan)]
