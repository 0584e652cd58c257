"""The tcp transport's sending side: chunks over a plain TCP connection, no copies of ours.

``write`` cuts the plan into chunks (:func:`~pd_transfer.transport.copy.packing.layout_chunks`) and
queues them on the link (:class:`~pd_transfer.transport.tcp.link.TcpLink`), whose sender thread
sends each as one frame (:mod:`~pd_transfer.transport.tcp.sockets`): a msgpack header naming the
destination runs, then the payload, handed to ``sendmsg`` as memoryviews of
the source regions. Pieces shorter than ``direct_min_nbytes`` on average are
gathered into a staging buffer first (:mod:`~pd_transfer.transport.tcp.iovecs`). The receiver
(:class:`~pd_transfer.transport.tcp.receiver.TcpReceiver`) checks each chunk's runs before it
receives the payload straight into the destination pages, and acks it; the
write returns after the receiver's final ``done``.

Streams: a link to a peer is ``streams`` connections (default 2), each with
its own sender thread (a *lane*, :class:`~pd_transfer.transport.tcp.link.TcpLink`). A write of
several chunks is striped over them, chunk by chunk, each lane's share one
transfer of its own on its connection (the receiver checks and counts each);
the write returns when every share has landed, and fails with the first
share that fails (the others are abandoned). The plan's last run (a room's
aux row) is sent only once the rest has landed, so that it still lands last,
as it does on one connection: on its own when it is small, else with the
last chunk. A write of one chunk takes the lane with the fewest bytes in
flight, so a small room is not queued behind a large one. One sender thread
spends most of its time in ``sendmsg``, the kernel reading the source pages:
with 65,536 pieces of 2 KiB, two lanes moved them in 55-69 ms where one took
66-81 ms (loopback, 2 cores).

Flow control: per link (= per peer) at most ``window_nbytes`` of chunks are
sent and not yet acked, across all writes sharing the link: each lane holds
an equal share of the window. A chunk waits for credit unless nothing is in
flight on its lane (so a chunk larger than the share still goes, alone).
``TcpLink.max_in_flight_nbytes`` records a lane's high-water mark.

Authentication: with an ``auth`` hook (the agent builds it from the shared
secret, :mod:`pd_transfer.agent.data_auth`) every connection runs the
mutual HMAC handshake before its first chunk; a refused handshake fails the
write with the refusal's code (``auth_failed``, ...). Encryption: this
transport sends the bytes in the clear. A deployment with CURVE keys uses
:class:`~pd_transfer.transport.zmq.transport.ZmqTcpTransport` instead (ZeroMQ CURVE, the older, slower
data path with the same contracts); the agent picks it
(:mod:`pd_transfer.agent.dataplane`).

Threads: this layer's only exception to "one event loop, no threads" (see
STYLE.md). Blocking ``sendmsg``/``recvmsg_into`` in one thread per
connection, with the GIL released, ran faster than asyncio's non-blocking
socket calls, which copy through Python per call.

A receiver that stops answering makes ``write`` wait for credit or for its
``done``; a peer not listening makes it wait while the link reconnects.
Callers bound every write with their room timeout; liveness is the agent's
heartbeat's job. OS errors are translated to TransportError here.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind, wire_room
from pd_transfer.transport.copy.packing import ChunkLayout, layout_chunks
from pd_transfer.transport.regions import Regions
from pd_transfer.transport.tcp.frames import EndHeader
from pd_transfer.transport.tcp.iovecs import DIRECT_MIN_NBYTES
from pd_transfer.transport.tcp.link import LinkOptions, TcpLink
from pd_transfer.transport.tcp.sockets import Authenticator, parse_address

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan

DEFAULT_CHUNK_NBYTES = 16 << 20
DEFAULT_WINDOW_NBYTES = 64 << 20
DEFAULT_STREAMS = 2
_INLINE_LAYOUT_RUNS = 4096  # plans of fewer runs are cut on the loop (a thread hop costs more)


class TcpTransport(Transport):
    """Plain-socket tcp data plane.

    ``auth``: the connection handshake (None: authentication off).
    """

    kind = TransportKind.TCP

    def __init__(
        self,
        *,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        window_nbytes: int = DEFAULT_WINDOW_NBYTES,
        streams: int = DEFAULT_STREAMS,
        auth: Authenticator | None = None,
        direct_min_nbytes: int = DIRECT_MIN_NBYTES,
        connect_timeout_s: float = 5.0,
        handshake_timeout_s: float = 10.0,
    ) -> None:
        super().__init__()
        if chunk_nbytes <= 0 or window_nbytes <= 0 or streams <= 0:
            raise ValueError("chunk_nbytes, window_nbytes and streams must be positive")
        self.chunk_nbytes = chunk_nbytes
        self.window_nbytes = window_nbytes
        self.streams = streams
        self.options = LinkOptions(
            connect_timeout_s=connect_timeout_s,
            handshake_timeout_s=handshake_timeout_s,
            direct_min_nbytes=direct_min_nbytes,
            auth=auth,
        )

    async def connect(self, peer: PeerEndpoint) -> TcpLink:
        """A link to ``peer``; it connects in the background (and reconnects when needed)."""
        if not peer.data_address:
            raise TransportError(
                f"peer {peer.peer_id} publishes no data address",
                code=Reason.TRANSPORT_UNSUPPORTED,
                hint="start a TcpReceiver on the decode side and register its address",
            )
        address = parse_address(peer.data_address)
        share = max(1, self.window_nbytes // self.streams)
        link = TcpLink(self, peer, address, share, self.options)
        link.lanes += [TcpLink(self, peer, address, share, self.options) for _ in range(self.streams - 1)]
        return self._adopt(link)

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, TcpLink)
        src = self._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
        sizes = {region_id: mapped.nbytes for region_id, mapped in src.items()}
        dst_sizes = link.peer.region_nbytes or None  # checked again by the receiver
        striped = len(link.lanes) > 1 and plan.total_nbytes > self.chunk_nbytes
        split = plan.split_last(self.chunk_nbytes // 16) if striped else None
        layouts = await self._layout(split[0] if split else plan, sizes, dst_sizes)
        tail = await self._layout(split[1], sizes, dst_sizes) if split else layouts[-1:] if striped else []
        if striped and not split:
            layouts = layouts[:-1]
        total = sum(layout.nbytes for layout in layouts + tail)
        shares = _stripe(layouts, link.lanes)
        if len(shares) == 1:
            lane, share = shares[0]
            await _write_share(lane, share, src, room, generation)
        else:
            await _all([_write_share(lane, share, src, room, generation) for lane, share in shares])
        if tail:  # the plan's last run lands after all the others, as on one connection
            await _write_share(_least_busy(link.lanes), [replace(tail[0], seq=0)], src, room, generation)
        link.nbytes_written += total
        link.num_writes += 1
        return total

    async def _layout(self, plan, sizes: dict, dst_sizes: dict | None) -> list[ChunkLayout]:
        if plan.num_runs < _INLINE_LAYOUT_RUNS:
            return layout_chunks(plan, sizes, self.chunk_nbytes, dst_sizes=dst_sizes)
        return await asyncio.to_thread(layout_chunks, plan, sizes, self.chunk_nbytes, dst_sizes=dst_sizes)


def _stripe(layouts: list[ChunkLayout], lanes: list[TcpLink]) -> list[tuple]:
    """``(lane, its chunks)`` pairs: chunks dealt out in turn, renumbered per lane; a
    write of one chunk (or none) on the lane with the fewest bytes in flight."""
    if len(layouts) < 2 or len(lanes) < 2:
        return [(_least_busy(lanes), layouts)]
    n = min(len(lanes), len(layouts))
    return [
        (lanes[i], [replace(layout, seq=seq) for seq, layout in enumerate(layouts[i::n])]) for i in range(n)
    ]


def _least_busy(lanes: list[TcpLink]) -> TcpLink:
    return min(lanes, key=lambda lane: lane.in_flight_nbytes)


async def _write_share(lane: TcpLink, layouts: list[ChunkLayout], src, room: RoomId, generation: int) -> int:
    """One transfer on one lane: its chunks, then its end; returns once all of it landed."""
    total = sum(layout.nbytes for layout in layouts)
    xfer = lane.open_xfer(wire_room(room), generation)
    try:
        for layout in layouts:
            if xfer.result.done():
                break  # refused mid-way: stop sending, report the receiver's reason
            await lane.acquire(layout.nbytes)
            lane.submit_chunk(xfer, layout, src)
        if not xfer.result.done():
            lane.submit_end(xfer, EndHeader(xfer.xfer_id, xfer.room, generation, len(layouts), total))
        landed = await xfer.result
    finally:
        lane.close_xfer(xfer)
    if landed != total:
        raise TransportError(
            f"{lane.peer.peer_id} acknowledged {landed} of {total} bytes of room {room}",
            code=Reason.TRANSFER_INCOMPLETE,
        )
    return total


async def _all(writes: list) -> None:
    """Run the shares together; the first to fail fails the write and the others stop."""
    tasks = [asyncio.ensure_future(write) for write in writes]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            task.cancel()  # a share still sending or waiting: abandoned (its chunks skipped)
        await asyncio.gather(*tasks, return_exceptions=True)
