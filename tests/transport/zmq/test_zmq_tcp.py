"""The ZeroMQ tcp variant (used with CURVE): same bytes, same refusals, same room admission."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from pd_transfer.errors import Reason
from pd_transfer.transport import (
    ByteRanges,
    PeerEndpoint,
    RoomPolicy,
    ZmqTcpReceiver,
    ZmqTcpTransport,
)
from pd_transfer.transport.tcp.frames import decode_reply

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("inline_nbytes", [256 << 10, 0], ids=["inline", "threaded-scatter"])
@pytest.mark.parametrize("case", [("llama", 2, 2), ("llama", 2, 4)], ids=["direct", "sliced-2-4"])
async def test_zmq_write_lands_exactly_the_oracle_bytes(scenario, case, inline_nbytes):
    sc = scenario(*case)
    transport = ZmqTcpTransport(chunk_nbytes=96 << 10)
    receivers = {
        rank: ZmqTcpReceiver("127.0.0.1", regions, inline_nbytes=inline_nbytes)
        for rank, regions in sc.world.decode_buffers.items()
    }
    for receiver in receivers.values():
        await receiver.start()
    links = {
        rank: await transport.connect(PeerEndpoint("d", data_address=r.address))
        for rank, r in receivers.items()
    }
    results = await asyncio.gather(
        *(transport.write(links[p.dst_rank], p, sc.src(p), room=1) for p in sc.plans)
    )
    assert results == [p.total_nbytes for p in sc.plans]
    await transport.close()
    for receiver in receivers.values():
        assert receiver.stats.frames_refused == 0
        await receiver.stop()
    assert sc.world.verify(sc.requests) == []


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


async def test_zmq_receiver_refuses_bad_frames_and_unexpected_rooms_and_keeps_serving():
    region = np.zeros(4096, np.uint8)
    receiver = ZmqTcpReceiver("127.0.0.1", {"kv": region}, policy=RoomPolicy.EXPECTED)
    async with receiver:
        receiver.expect(5, 0, {"kv": ByteRanges.merged(np.array([0]), np.array([1024]))})
        peer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(receiver.address)

        async def reply():
            return decode_reply(await asyncio.wait_for(peer.recv(), 5))

        await peer.send_multipart([_chunk_header(1, [[0, 4000, 128]], room="5"), b"\x01" * 128])
        assert (await reply()).reason() is Reason.RUN_OUT_OF_REGION
        await peer.send_multipart([_chunk_header(2, [[0, 2048, 16]], room="5"), b"\x01" * 16])
        assert (await reply()).reason() is Reason.RUN_OUT_OF_REGION  # outside the room's pages
        await peer.send_multipart([_chunk_header(3, [[0, 0, 16]], room="x"), b"\x01" * 16])
        assert (await reply()).reason() is Reason.UNKNOWN_ROOM
        await peer.send_multipart([b"\xc1 not msgpack", b"x"])  # no xfer to answer: counted only
        assert not region.any()
        await peer.send_multipart([_chunk_header(4, [[0, 64, 16]], room="5"), b"\x02" * 16])
        ack = await reply()
        assert (ack.xfer, ack.nbytes) == (4, 16) and region[64:80].tolist() == [2] * 16
        await receiver.fence(5, 0)
        await peer.send_multipart([_chunk_header(5, [[0, 64, 16]], room="5"), b"\x03" * 16])
        assert (await reply()).reason() is Reason.STALE_GENERATION
        assert receiver.stats.frames_refused == 5
        peer.close(linger=0)
