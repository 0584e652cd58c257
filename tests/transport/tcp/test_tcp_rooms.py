"""The tcp receiver admits only the rooms decode expects, only into their pages, and fences."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import numpy as np
import pytest

from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.transport import (
    ByteRanges,
    PeerEndpoint,
    RoomPolicy,
    TcpReceiver,
    TcpTransport,
    item_ranges,
)
from pd_transfer.transport.tcp.frames import decode_reply
from pd_transfer.transport.tcp.sockets import PREFIX, Kind, parse_address, prefix


def _ranges(**regions) -> dict[str, ByteRanges]:
    return {
        r: ByteRanges.merged(np.array([a for a, _ in pairs]), np.array([b for _, b in pairs]))
        for r, pairs in regions.items()
    }


def _chunk(xfer: int, runs: list, room: str, gen: int = 0, regions=("kv",)) -> bytes:
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


async def _exchange(address: str, frames: list[tuple[bytes, bytes]]) -> list:
    reader, writer = await asyncio.open_connection(*parse_address(address))
    replies = []
    for header, payload in frames:
        writer.write(prefix(Kind.DATA, len(header), len(payload)) + header + payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(PREFIX.size), 5)
        replies.append(decode_reply(await reader.readexactly(PREFIX.unpack(head)[4])))
    writer.close()
    return replies


def test_byte_ranges_merge_and_cover():
    ranges = ByteRanges.merged(np.array([100, 0, 16, 200, 50]), np.array([150, 16, 32, 210, 60]))
    assert ranges.starts.tolist() == [0, 50, 100, 200] and ranges.ends.tolist() == [32, 60, 150, 210]
    covered = ranges.covers(
        np.array([0, 8, 31, 32, 100, 149, 199, 205]), np.array([32, 24, 1, 1, 50, 2, 2, 5])
    )
    assert covered.tolist() == [True, True, True, False, True, False, False, True]


def test_item_ranges_are_the_pages_of_every_view(scenario):
    sc = scenario("llama", 2, 2)
    geometry = sc.dst_geometry(sc.plans[0])
    ranges = item_ranges(geometry.views, {Pool.KV: [3, 1]})
    views = [v for v in geometry.views if v.pool is Pool.KV]
    expected = sum(2 * v.item_nbytes for v in views)
    assert sum(int((r.ends - r.starts).sum()) for r in ranges.values()) == expected
    # every run of a plan for those pages is inside; a run of page 2 is not
    view = views[0]
    stride = view.item_nbytes  # NHD pages are contiguous items
    at = np.array([view.offset_nbytes + 3 * stride, view.offset_nbytes + 2 * stride])
    assert ranges[view.region].covers(at, np.array([stride, stride])).tolist() == [True, False]


@pytest.mark.asyncio
async def test_only_expected_rooms_write_and_only_into_their_pages():
    region = np.zeros(4096, np.uint8)
    receiver = TcpReceiver("127.0.0.1", {"kv": region}, policy=RoomPolicy.EXPECTED)
    async with receiver:
        receiver.expect(7, 3, _ranges(kv=[(1024, 2048)]))
        replies = await _exchange(
            receiver.address,
            [
                (_chunk(1, [[0, 0, 16]], room="8", gen=3), b"\x01" * 16),  # not expected
                (_chunk(2, [[0, 2040, 16]], room="7", gen=3), b"\x01" * 16),  # leaves its pages
                (_chunk(3, [[0, 1024, 16]], room="7", gen=2), b"\x01" * 16),  # older generation
                (_chunk(4, [[0, 1024, 16]], room="7", gen=4), b"\x01" * 16),  # newer generation
                (_chunk(5, [[0, 1024, 16], [0, 2032, 16]], room="7", gen=3), b"\x02" * 32),
            ],
        )
        assert [r.reason() for r in replies[:4]] == [
            Reason.UNKNOWN_ROOM,
            Reason.RUN_OUT_OF_REGION,
            Reason.STALE_GENERATION,
            Reason.BAD_GENERATION,
        ]
        assert "outside the pages this room expects" in replies[1].text
        assert (replies[4].xfer, replies[4].nbytes) == (5, 32)
        assert int(np.count_nonzero(region)) == 32 and region[1024:1040].tolist() == [2] * 16
        receiver.forget(7)  # landed: its later chunks are refused
        late = await _exchange(
            receiver.address, [(_chunk(6, [[0, 1024, 16]], room="7", gen=3), b"\x03" * 16)]
        )
        assert late[0].reason() is Reason.UNKNOWN_ROOM
        assert region[1024:1040].tolist() == [2] * 16
        assert receiver.stats.refused[Reason.UNKNOWN_ROOM] == 2


@pytest.mark.asyncio
async def test_fence_drops_the_expectation_and_refuses_the_generation():
    region = np.zeros(4096, np.uint8)
    receiver = TcpReceiver("127.0.0.1", {"kv": region}, policy=RoomPolicy.EXPECTED)
    async with receiver:
        receiver.expect(5, 1, _ranges(kv=[(0, 4096)]))
        await receiver.fence(5, 1)
        reply = (
            await _exchange(receiver.address, [(_chunk(1, [[0, 0, 16]], room="5", gen=1), b"\x01" * 16)])
        )[0]
        assert reply.reason() is Reason.STALE_GENERATION and "was aborted" in reply.text
        assert not region.any()


@pytest.mark.asyncio
async def test_a_fence_cuts_off_a_chunk_stalled_mid_payload():
    region = np.zeros(1 << 20, np.uint8)
    receiver = TcpReceiver("127.0.0.1", {"kv": region}, fence_grace_s=0.2, inline_nbytes=0)
    async with receiver:
        reader, writer = await asyncio.open_connection(*parse_address(receiver.address))
        header = _chunk(1, [[0, 0, 1 << 20]], room="5")
        writer.write(prefix(Kind.DATA, len(header), 1 << 20) + header + b"\x01" * 4096)
        await writer.drain()
        for _ in range(100):  # until the receiver admitted the chunk and waits for the rest
            if receiver.admission.busy("5", 0):
                break
            await asyncio.sleep(0.02)
        assert receiver.admission.busy("5", 0)
        await asyncio.wait_for(receiver.fence(5, 0), 5)
        assert not receiver.admission.busy("5", 0)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # its connection was closed
        writer.close()


def _one_run_plan(nbytes: int):
    from pd_transfer.layout.lowering import RunBatch, TransferPlan

    zero = np.array([0], np.int64)
    return TransferPlan(
        "p0", "d0", (RunBatch("s", "kv", zero, zero, np.array([nbytes]), np.array([1]), 0, 0),)
    )


def _lost_records(caplog, level: int) -> list:
    return [
        r
        for r in caplog.records
        if "lost" in r.getMessage() and r.levelno == level and r.name == "pd_transfer.transport.tcp.transport"
    ]


async def _write_to_failing_peer(serve, nbytes: int):
    """Write ``nbytes`` to a fake receiver running ``serve`` (which hangs up); the error
    raised, the link (still open) and what closes the transport and the server."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = TcpTransport(chunk_nbytes=4096)
    link = await transport.connect(PeerEndpoint("d0", data_address=f"tcp://127.0.0.1:{port}"))

    async def close() -> None:
        await transport.close()
        server.close()

    try:
        with pytest.raises(TransportError) as info:
            await asyncio.wait_for(
                transport.write(link, _one_run_plan(nbytes), {"s": np.ones(nbytes, np.uint8)}), 5
            )
    except BaseException:  # the test fails: do not leave the link's threads behind
        await close()
        raise
    return info.value, link, close


@pytest.mark.asyncio
async def test_a_connection_lost_mid_transfer_fails_the_write(caplog):
    caplog.set_level(logging.INFO, logger="pd_transfer.transport.tcp.transport")

    async def hang_up(reader, writer):
        await reader.readexactly(PREFIX.size)  # the first chunk starts: drop the connection
        writer.close()

    error, link, close = await _write_to_failing_peer(hang_up, 1 << 20)
    assert error.code is Reason.TRANSPORT_FAILED
    assert len(link.lanes) == 2  # the write was striped: both connections broke, both gave back
    assert all(lane.in_flight_nbytes == 0 for lane in link.lanes)
    assert _lost_records(caplog, logging.WARNING)  # bytes were in flight: an alarm
    await close()


@pytest.mark.asyncio
async def test_a_receiver_that_hangs_up_on_unacknowledged_bytes_is_an_alarm(caplog):
    """A clean close (FIN, every byte read) with a chunk not acknowledged yet: the write
    fails and the log says so as a warning, unlike the close of an idle connection."""
    caplog.set_level(logging.INFO, logger="pd_transfer.transport.tcp.transport")

    async def read_then_hang_up(reader, writer):
        head = PREFIX.unpack(await reader.readexactly(PREFIX.size))
        await reader.readexactly(head[4] + head[5])  # header and payload, then goodbye
        writer.close()

    error, _, close = await _write_to_failing_peer(read_then_hang_up, 4096)
    assert error.code is Reason.TRANSPORT_FAILED
    assert _lost_records(caplog, logging.WARNING) and not _lost_records(caplog, logging.INFO)
    await close()


@pytest.mark.asyncio
async def test_the_link_reconnects_when_the_receiver_is_back(caplog):
    caplog.set_level(logging.INFO, logger="pd_transfer.transport.tcp.transport")
    region = np.zeros(1 << 16, np.uint8)
    src = {"s": np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)}
    plan = _one_run_plan(1 << 16)
    receiver = TcpReceiver("127.0.0.1", {"kv": region})
    await receiver.start()
    port = int(receiver.address.rsplit(":", 1)[1])
    transport = TcpTransport(chunk_nbytes=4096)
    link = await transport.connect(PeerEndpoint("d0", data_address=receiver.address))
    assert await transport.write(link, plan, src, room=1) == 1 << 16
    await receiver.stop()
    for _ in range(100):  # the idle connection, closed by the receiver: news, not an alarm
        if _lost_records(caplog, logging.INFO):
            break
        await asyncio.sleep(0.02)
    assert _lost_records(caplog, logging.INFO) and not _lost_records(caplog, logging.WARNING)
    with pytest.raises(asyncio.TimeoutError):  # nobody listens: it waits, as for a silent peer
        await asyncio.wait_for(transport.write(link, plan, src, room=2), 0.5)
    region[:] = 0
    receiver = TcpReceiver("127.0.0.1", {"kv": region}, port=port)
    await receiver.start()
    assert await asyncio.wait_for(transport.write(link, plan, src, room=3), 10) == 1 << 16
    assert np.array_equal(region, src["s"])
    await transport.close()
    await receiver.stop()


@pytest.mark.asyncio
async def test_without_native_io_the_memoryview_path_lands_the_same_bytes(scenario, monkeypatch):
    from pd_transfer.transport.tcp import native_io

    monkeypatch.setattr(native_io, "AVAILABLE", False)
    sc = scenario("llama", 2, 4)
    transport = TcpTransport(chunk_nbytes=256 << 10)
    receivers = {
        rank: TcpReceiver("127.0.0.1", regions, inline_nbytes=0)
        for rank, regions in sc.world.decode_buffers.items()
    }
    for receiver in receivers.values():
        await receiver.start()
    for plan in sc.plans:
        link = await transport.connect(PeerEndpoint("d", data_address=receivers[plan.dst_rank].address))
        assert await transport.write(link, plan, sc.src(plan)) == plan.total_nbytes
    await transport.close()
    for receiver in receivers.values():
        await receiver.stop()
    assert sc.world.verify(sc.requests) == []


@pytest.mark.parametrize(
    "layout",
    [
        Layout.NHD,
        Layout.HND,
        Layout.LAYER_FIRST,
        Layout.PAGE_FIRST,
        Layout.PAGE_FIRST_DIRECT,
        Layout.PAGE_HEAD,
    ],
    ids=lambda layout: layout.value,
)
@pytest.mark.parametrize("kind, tps", [("llama", (2, 4)), ("llama", (4, 2)), ("gdn", (2, 4))])
def test_every_planned_run_lies_in_the_ranges_of_the_rooms_items(scenario, layout, kind, tps):
    sc = scenario(kind, *tps, dst_layout=layout)
    dst_indices = {pool: dst for pool, (_, dst) in sc.requests.items()}
    for plan in sc.plans:
        ranges = item_ranges(sc.dst_geometry(plan).views, dst_indices)
        for batch in plan.batches:
            _, dst, nbytes = batch.byte_runs()
            assert ranges[batch.dst_region].covers(dst, nbytes).all(), batch.dst_region
        # and a run in an item the room did not ask for is not
        other = {pool: np.setdiff1d(np.arange(8), idx)[:1] for pool, idx in dst_indices.items()}
        stray = item_ranges(sc.dst_geometry(plan).views, other)
        for region, allowed in stray.items():
            if region in ranges:
                assert not ranges[region].covers(allowed.starts, allowed.ends - allowed.starts).any()
