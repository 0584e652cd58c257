"""The tcp transport: chunks over loopback land exactly; bad frames are refused, not written."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import msgpack
import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport import PeerEndpoint, TcpReceiver, TcpTransport
from pd_transfer.transport.tcp.frames import decode_reply
from pd_transfer.transport.tcp.sockets import PREFIX, Kind, parse_address, prefix

pytestmark = pytest.mark.asyncio
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_receiver_child.py")


def _endpoint(rank: str, regions: dict, address: str, *, sizes: bool = True) -> PeerEndpoint:
    return PeerEndpoint.from_maps(
        rank, {r: b.size for r, b in regions.items()} if sizes else {}, data_address=address
    )


class Decode:
    """One TcpReceiver per decode rank of a scenario."""

    def __init__(self, sc, **options) -> None:
        self.sc = sc
        self.receivers = {
            rank: TcpReceiver("127.0.0.1", regions, **options)
            for rank, regions in sc.world.decode_buffers.items()
        }

    async def __aenter__(self) -> Decode:
        for receiver in self.receivers.values():
            await receiver.start()
        return self

    async def __aexit__(self, *exc) -> None:
        for receiver in self.receivers.values():
            await receiver.stop()

    def endpoint(self, rank: str, **kw) -> PeerEndpoint:
        return _endpoint(rank, self.sc.world.decode_buffers[rank], self.receivers[rank].address, **kw)


@pytest.mark.parametrize("inline_nbytes", [256 << 10, 0], ids=["inline", "threaded-scatter"])
@pytest.mark.parametrize(
    "case",
    [("llama", 2, 2), ("llama", 2, 4), ("llama", 4, 2), ("gdn", 2, 4)],
    ids=["direct", "sliced-2-4", "sliced-4-2", "gdn"],
)
async def test_tcp_write_lands_exactly_the_oracle_bytes(scenario, case, inline_nbytes):
    sc = scenario(*case)
    transport = TcpTransport(chunk_nbytes=96 << 10)
    async with Decode(sc, inline_nbytes=inline_nbytes) as decode:
        links = {rank: await transport.connect(decode.endpoint(rank)) for rank in decode.receivers}
        results = await asyncio.gather(
            *(transport.write(links[p.dst_rank], p, sc.src(p), room=1) for p in sc.plans)
        )
        assert results == [p.total_nbytes for p in sc.plans]
        assert sum(r.stats.nbytes_landed for r in decode.receivers.values()) == sum(results)
        assert all(r.stats.frames_refused == 0 for r in decode.receivers.values())
        await transport.close()
    assert sc.world.verify(sc.requests) == []


async def test_bytes_in_flight_never_exceed_the_window(scenario):
    sc = scenario("llama", 2, 2, num_pages=40)
    chunk, window = 32 << 10, 128 << 10
    transport = TcpTransport(chunk_nbytes=chunk, window_nbytes=window, streams=1)
    async with Decode(sc) as decode:
        links = {rank: await transport.connect(decode.endpoint(rank)) for rank in decode.receivers}
        link = links[sc.plans[0].dst_rank]
        seen = []
        original = link.acquire

        async def watched(nbytes):
            await original(nbytes)
            seen.append(link.in_flight_nbytes)

        link.acquire = watched
        plan = sc.plans[0]
        # two rooms writing the same pages (same bytes) on one link share its window
        await asyncio.gather(
            transport.write(link, plan, sc.src(plan), room=1),
            transport.write(link, plan, sc.src(plan), room=2),
            *(transport.write(links[p.dst_rank], p, sc.src(p)) for p in sc.plans[1:]),
        )
        assert plan.total_nbytes > 8 * window  # the window really had to bind
        assert len(seen) >= 2 * plan.total_nbytes // chunk
        assert max(seen) <= window and link.max_in_flight_nbytes <= window
        assert link.max_in_flight_nbytes >= window - chunk  # and it was used, not serialised
        assert link.in_flight_nbytes == 0
        await transport.close()
    assert sc.world.verify(sc.requests) == []


async def test_a_long_write_is_striped_over_the_streams_within_one_window(scenario):
    """Three connections to the peer: a plan of many chunks goes over all three at once
    (each its own transfer), lands exactly, and the three together never hold more than
    the link's window."""
    sc = scenario("llama", 2, 4, num_pages=40)
    chunk, window = 32 << 10, 192 << 10
    transport = TcpTransport(chunk_nbytes=chunk, window_nbytes=window, streams=3)
    async with Decode(sc, inline_nbytes=0) as decode:
        links = {rank: await transport.connect(decode.endpoint(rank)) for rank in decode.receivers}
        plan = max(sc.plans, key=lambda p: p.total_nbytes)
        link = links[plan.dst_rank]
        assert len(link.lanes) == 3 and all(lane.window_nbytes == window // 3 for lane in link.lanes)
        together, per_lane = [], {id(lane): 0 for lane in link.lanes}
        for lane in link.lanes:

            def watch(lane=lane, original=lane.acquire):
                async def watched(nbytes):
                    await original(nbytes)
                    per_lane[id(lane)] += 1
                    together.append(sum(other.in_flight_nbytes for other in link.lanes))

                lane.acquire = watched

            watch()
        results = await asyncio.gather(
            *(transport.write(links[p.dst_rank], p, sc.src(p), room=1) for p in sc.plans)
        )
        assert results == [p.total_nbytes for p in sc.plans]
        receiver = decode.receivers[plan.dst_rank]
        assert plan.total_nbytes > 8 * window
        assert min(per_lane.values()) >= plan.total_nbytes // chunk // 3  # every lane sent its third
        assert max(together) <= window and max(together) > window // 3  # overlapped, bounded
        assert receiver.stats.transfers_done == 4  # one transfer per lane, then the last run
        assert all(lane.in_flight_nbytes == 0 for lane in link.lanes)
        await transport.close()
    assert sc.world.verify(sc.requests) == []


@pytest.mark.parametrize(
    "tail_nbytes, alone",
    [(64, True), (40 << 10, False)],
    ids=["small-last-run-alone", "large-last-run-in-the-last-chunk"],
)
async def test_a_striped_write_lands_its_last_run_last(tail_nbytes, alone):
    """As on one connection, the plan's last run (a room's aux row) lands after every
    other byte: sent on its own once the striped rest has landed, or, when it is large,
    inside the last chunk sent after the others."""
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    chunk, body = 16 << 10, 20
    src = {"s": np.random.default_rng(1).integers(0, 256, (body << 12) + tail_nbytes, np.uint8)}
    region = np.zeros(src["s"].size, np.uint8)
    pages = np.arange(body, dtype=np.int64) << 12
    plan = TransferPlan(
        "p0",
        "d0",
        (
            RunBatch(
                "s", "kv", pages, pages[::-1].copy(), np.full(body, 4096), np.ones(body, np.int64), 0, 0
            ),
            RunBatch(
                "s",
                "kv",
                np.array([body << 12]),
                np.array([body << 12]),
                np.array([tail_nbytes]),
                np.array([1]),
                0,
                0,
            ),
        ),
    )
    landed = []
    transport = TcpTransport(chunk_nbytes=chunk, streams=2)
    async with TcpReceiver(
        "127.0.0.1", {"kv": region}, on_landed=lambda room, gen, n: landed.append(n)
    ) as receiver:
        link = await transport.connect(PeerEndpoint("d0", data_address=receiver.address))
        assert await transport.write(link, plan, src, room=1) == plan.total_nbytes
        await transport.close()
    last_chunk = plan.total_nbytes - (plan.total_nbytes - 1) // chunk * chunk
    assert landed[-1] == (tail_nbytes if alone else last_chunk)
    assert len(landed) == 3 and sum(landed) == plan.total_nbytes  # two striped shares first
    expected = src["s"].copy()
    expected[: body << 12] = src["s"][: body << 12].reshape(body, 4096)[::-1].ravel()
    assert np.array_equal(region, expected)


async def test_a_one_chunk_write_takes_the_least_busy_stream():
    region = np.zeros(4096, np.uint8)
    src = {"s": np.arange(4096, dtype=np.uint16).astype(np.uint8)}
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    zero = np.array([0], np.int64)
    plan = TransferPlan("p0", "d0", (RunBatch("s", "kv", zero, zero, np.array([4096]), np.array([1]), 0, 0),))
    transport = TcpTransport(streams=2)
    async with TcpReceiver("127.0.0.1", {"kv": region}) as receiver:
        link = await transport.connect(PeerEndpoint("d0", data_address=receiver.address))
        first, second = link.lanes
        first.in_flight_nbytes = 1  # as if another write's chunk were out on it
        try:
            assert await transport.write(link, plan, src, room=1) == 4096
        finally:
            first.in_flight_nbytes = 0
        assert (first._conn_id, second._conn_id) == (0, 1)  # only the idle lane connected
        assert np.array_equal(region, src["s"])
        await transport.close()


class RawPeer:
    """A hand-driven data connection: frames of our choosing, replies read back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: str) -> RawPeer:
        return cls(*await asyncio.open_connection(*parse_address(address)))

    async def send(self, header: bytes, payload: bytes = b"", kind: Kind = Kind.DATA) -> None:
        self.writer.write(prefix(kind, len(header), len(payload)) + header + payload)
        await self.writer.drain()

    async def recv(self):
        head = await asyncio.wait_for(self.reader.readexactly(PREFIX.size), 5)
        return decode_reply(await self.reader.readexactly(PREFIX.unpack(head)[4]))

    def close(self) -> None:
        self.writer.close()


def _chunk_header(xfer: int, runs: list, regions=("kv",), room="evil", gen=0) -> bytes:
    return msgpack.packb(
        {
            "v": 1,
            "t": "chunk",
            "xfer": xfer,
            "room": room,
            "gen": gen,
            "seq": 0,
            "regions": list(regions),
            "runs": np.array(runs, "<i8").tobytes(),
        },
        use_bin_type=True,
    )


async def test_out_of_region_frames_are_refused_and_the_receiver_keeps_serving():
    region = np.zeros(4096, np.uint8)
    async with TcpReceiver("127.0.0.1", {"kv": region}) as receiver:
        peer = await RawPeer.open(receiver.address)
        await peer.send(_chunk_header(1, [[0, 4000, 128]]), b"\x01" * 128)
        reply = await peer.recv()
        assert reply.reason() is Reason.RUN_OUT_OF_REGION and "4000" in reply.text
        await peer.send(_chunk_header(2, [[0, 0, 16]], regions=("other",)), b"\x01" * 16)
        assert (await peer.recv()).reason() is Reason.UNKNOWN_REGION
        await peer.send(b"\xc1 not msgpack", b"x")  # no xfer to answer: counted only
        await peer.send(_chunk_header(3, [[0, 0, 16]]), b"\x01" * 15)
        assert (await peer.recv()).reason() is Reason.BAD_FRAME
        assert not region.any()
        # still serving: a good chunk lands and is acked
        await peer.send(_chunk_header(4, [[0, 64, 16]]), b"\x02" * 16)
        ack = await peer.recv()
        assert (ack.xfer, ack.nbytes) == (4, 16)
        assert region[64:80].tolist() == [2] * 16 and int(np.count_nonzero(region)) == 16
        assert receiver.stats.frames_refused == 4
        assert receiver.stats.refused[Reason.RUN_OUT_OF_REGION] == 1
        peer.close()


async def test_receiver_refusal_fails_the_write_with_its_reason(scenario):
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    small = {r: np.zeros(b.size // 2, np.uint8) for r, b in sc.dst(plan).items()}
    transport = TcpTransport(chunk_nbytes=64 << 10)
    async with TcpReceiver("127.0.0.1", small) as receiver:
        # an endpoint without sizes: the sender cannot pre-check, the receiver must
        link = await transport.connect(_endpoint(plan.dst_rank, small, receiver.address, sizes=False))
        with pytest.raises(TransportError) as info:
            await asyncio.wait_for(transport.write(link, plan, sc.src(plan), room=1), 10)
        assert info.value.code is Reason.RUN_OUT_OF_REGION
        assert receiver.stats.refused[Reason.RUN_OUT_OF_REGION] >= 1
        await transport.close()


async def test_sender_checks_against_the_endpoint_sizes_before_sending(scenario):
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    small = {r: np.zeros(b.size // 2, np.uint8) for r, b in sc.dst(plan).items()}
    transport = TcpTransport()
    async with TcpReceiver("127.0.0.1", small) as receiver:
        link = await transport.connect(_endpoint(plan.dst_rank, small, receiver.address))
        with pytest.raises(TransportError) as info:
            await transport.write(link, plan, sc.src(plan))
        assert info.value.code is Reason.RUN_OUT_OF_REGION
        assert receiver.stats.chunks_landed == 0 and receiver.stats.frames_refused == 0
        await transport.close()


async def test_fenced_generation_is_refused_and_the_next_one_lands(scenario):
    sc = scenario("llama", 2, 2)
    plan = sc.plans[0]
    transport = TcpTransport(chunk_nbytes=64 << 10)
    async with Decode(sc, inline_nbytes=0) as decode:
        receiver = decode.receivers[plan.dst_rank]
        link = await transport.connect(decode.endpoint(plan.dst_rank))
        await receiver.fence(3, 0)
        with pytest.raises(TransportError) as info:
            await transport.write(link, plan, sc.src(plan), room=3, generation=0)
        assert info.value.code is Reason.STALE_GENERATION
        assert await transport.write(link, plan, sc.src(plan), room=3, generation=1) == plan.total_nbytes
        await transport.close()


async def test_write_to_a_silent_peer_waits_for_the_callers_timeout():
    transport = TcpTransport()
    link = await transport.connect(PeerEndpoint("d0", data_address="tcp://127.0.0.1:1"))
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    one = np.array([0], np.int64)
    plan = TransferPlan("p0", "d0", (RunBatch("s", "kv", one, one, np.array([64]), np.array([1]), 0, 0),))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(transport.write(link, plan, {"s": np.ones(64, np.uint8)}), 0.3)
    assert link.in_flight_nbytes == 0  # the abandoned chunk's credit came back
    await transport.close()


async def test_peer_without_data_address_is_refused():
    with pytest.raises(TransportError) as info:
        await TcpTransport().connect(PeerEndpoint("d0"))
    assert info.value.code is Reason.TRANSPORT_UNSUPPORTED


async def test_receiver_in_another_process(scenario, segments):
    sc = scenario("llama", 2, 4, seed=5)
    placed = {rank: segments(regions) for rank, regions in sc.world.decode_buffers.items()}
    names = {rank: {r: s.name for r, s in segs.items()} for rank, segs in placed.items()}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        CHILD,
        json.dumps(names),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    transport = TcpTransport(chunk_nbytes=128 << 10)
    try:
        addresses = json.loads(await asyncio.wait_for(child.stdout.readline(), 60))
        for plan in sc.plans:
            link = await transport.connect(_endpoint(plan.dst_rank, sc.dst(plan), addresses[plan.dst_rank]))
            assert (
                await asyncio.wait_for(transport.write(link, plan, sc.src(plan), room=1), 30)
                == plan.total_nbytes
            )
        await transport.close()
    finally:
        child.stdin.close()
        report = await asyncio.wait_for(child.stdout.readline(), 30)
        await asyncio.wait_for(child.wait(), 30)
    assert json.loads(report)["refused"] == 0
    for rank, segs in placed.items():
        for region_id, segment in segs.items():
            sc.world.decode_buffers[rank][region_id][:] = segment.array
    assert sc.world.verify(sc.requests) == []


async def test_receiver_reports_each_completed_transfer(scenario):
    sc = scenario("gdn", 2, 2)
    plan = sc.plans[0]
    landed = []
    receiver = TcpReceiver("127.0.0.1", sc.dst(plan), on_landed=lambda *a: landed.append(a))
    transport = TcpTransport(chunk_nbytes=1024, streams=1)  # one transfer: one report
    async with receiver:
        link = await transport.connect(_endpoint(plan.dst_rank, sc.dst(plan), receiver.address))
        await transport.write(link, plan, sc.src(plan), room=9, generation=4)
        await transport.close()
    assert landed == [("9", 4, plan.total_nbytes)]  # the room as its frames carry it
    assert receiver.stats.transfers_done == 1
    assert receiver.stats.chunks_landed == -(-plan.total_nbytes // 1024)
