"""The tcp data plane over ZeroMQ: gathered chunks on a DEALER socket (the CURVE variant).

The agent uses this variant when CURVE keys are configured: ZeroMQ encrypts
the bytes. It keeps every contract of :class:`~pd_transfer.transport.tcp.transport.TcpTransport` and speaks
to a :class:`~pd_transfer.transport.zmq.receiver.ZmqTcpReceiver`, but each payload is gathered into
a buffer and copied by ZeroMQ on the way in, so it runs at about half the
plain transport's speed (docs/performance.md).

``write`` cuts the plan into chunks (:func:`~pd_transfer.transport.copy.packing.layout_chunks`),
gathers each into a fresh buffer in a worker thread while the previous one is
on the wire, and sends ``[header, payload]`` with ``copy=False`` (zmq sends
from our buffer; no copy into a message). The receiver
(:class:`~pd_transfer.transport.tcp.receiver.TcpReceiver`) checks and scatters each chunk and
acks it; the write returns after the receiver's final ``done``.

Flow control: per link (= per peer) at most ``window_nbytes`` of chunks are
sent and not yet acked, across all writes sharing the link. A chunk waits for
credit unless nothing is in flight (so a chunk larger than the window still
goes, alone). ``TcpLink.max_in_flight_nbytes`` records the high-water mark.
The last chunk of a write of several goes only once the others are acked:
the receiver scatters large chunks in threads, and the plan's last run (a
room's aux row) must land last.

A receiver that stops answering makes ``write`` wait for credit or for its
``done``: callers bound every write with their room timeout; liveness is the
agent's heartbeat's job. zmq errors are translated to TransportError here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import zmq
import zmq.asyncio

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint, RoomId, Transport, TransportKind, wire_room
from pd_transfer.transport.copy.packing import gather_chunk, layout_chunks
from pd_transfer.transport.regions import Regions
from pd_transfer.transport.tcp.frames import (
    MAX_HEADER_NBYTES,
    Ack,
    ChunkHeader,
    EndHeader,
    Fail,
    XferDone,
    decode_reply,
    encode,
)
from pd_transfer.transport.tcp.xfers import Xfer, settle

if TYPE_CHECKING:
    from pd_transfer.layout.lowering import TransferPlan

log = logging.getLogger("pd_transfer.transport.zmq")

DEFAULT_CHUNK_NBYTES = 4 << 20
DEFAULT_WINDOW_NBYTES = 64 << 20


class ZmqTcpLink(Link):
    def __init__(
        self, transport: ZmqTcpTransport, peer: PeerEndpoint, socket: zmq.asyncio.Socket, window_nbytes: int
    ) -> None:
        super().__init__(transport, peer)
        self.socket = socket
        self.window_nbytes = window_nbytes
        self.in_flight_nbytes = 0
        self.max_in_flight_nbytes = 0
        self._credit = asyncio.Condition()
        self._xfers: dict[int, Xfer] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.create_task(self._read_replies(), name=f"tcp-replies-{peer.peer_id}")

    def open_xfer(self, room: str) -> Xfer:
        xfer = Xfer(next(self._ids), room)
        self._xfers[xfer.xfer_id] = xfer
        return xfer

    async def close_xfer(self, xfer: Xfer) -> None:
        """Forget a finished or abandoned write and give back the credit its chunks hold."""
        self._xfers.pop(xfer.xfer_id, None)
        if xfer.unacked:
            await self._give_back(sum(xfer.unacked.values()))
            xfer.unacked.clear()

    async def acquire(self, nbytes: int) -> None:
        async with self._credit:
            await self._credit.wait_for(
                lambda: (
                    self._closed
                    or self.in_flight_nbytes == 0
                    or self.in_flight_nbytes + nbytes <= self.window_nbytes
                )
            )
            self.check_open()
            self.in_flight_nbytes += nbytes
            self.max_in_flight_nbytes = max(self.max_in_flight_nbytes, self.in_flight_nbytes)

    async def wait_acked(self, xfer: Xfer) -> None:
        """Return once every chunk of ``xfer`` sent so far is acknowledged, or it ended."""
        async with self._credit:
            await self._credit.wait_for(lambda: self._closed or not xfer.unacked or xfer.result.done())

    async def _give_back(self, nbytes: int) -> None:
        async with self._credit:
            self.in_flight_nbytes -= nbytes
            self._credit.notify_all()

    async def _read_replies(self) -> None:
        try:
            while True:
                frame = await self.socket.recv()
                try:
                    reply = decode_reply(frame)
                except TransportError as err:
                    log.warning("link %s: unreadable reply dropped: %s", self.peer.peer_id, err)
                    continue
                await self._dispatch(reply)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            self._fail_all(
                TransportError(
                    f"link to {self.peer.peer_id} closed with transfers in flight", code=Reason.LINK_CLOSED
                )
            )
            async with self._credit:  # wake writers waiting for credit or acks: they see it
                self._credit.notify_all()

    async def _dispatch(self, reply: Ack | XferDone | Fail) -> None:
        nbytes = settle(self._xfers, reply, self.peer.peer_id)
        await self._give_back(nbytes or 0)  # also wakes a writer waiting for the acks (wait_acked)

    def _fail_all(self, error: TransportError) -> None:
        for xfer in self._xfers.values():
            if not xfer.result.done():
                xfer.result.set_exception(error)

    async def _release(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        async with self._credit:  # wake writers waiting for credit: they see the link closed
            self._credit.notify_all()
        self.socket.close(linger=0)


class ZmqTcpTransport(Transport):
    kind = TransportKind.TCP

    def __init__(
        self,
        context: zmq.asyncio.Context | None = None,
        *,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        window_nbytes: int = DEFAULT_WINDOW_NBYTES,
        socket_options: Callable[[zmq.Socket], None] | None = None,
    ) -> None:
        super().__init__()
        # e.g. CURVE client keys: the agent knows them, this layer does not
        self.socket_options = socket_options
        self.context = context or zmq.asyncio.Context.instance()
        self.chunk_nbytes = chunk_nbytes
        self.window_nbytes = window_nbytes

    async def connect(self, peer: PeerEndpoint) -> ZmqTcpLink:
        if not peer.data_address:
            raise TransportError(
                f"peer {peer.peer_id} publishes no data address",
                code=Reason.TRANSPORT_UNSUPPORTED,
                hint="start a TcpReceiver on the decode side and register its address",
            )
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_NBYTES)  # replies are header-sized frames
        if self.socket_options is not None:
            self.socket_options(socket)
        try:
            socket.connect(peer.data_address)
        except zmq.ZMQError as err:
            socket.close(linger=0)
            raise TransportError(
                f"cannot connect to {peer.peer_id} at {peer.data_address}: {err}",
                code=Reason.TRANSPORT_FAILED,
            ) from None
        return self._adopt(ZmqTcpLink(self, peer, socket, self.window_nbytes))

    async def write(
        self, link: Link, plan: TransferPlan, src_regions: Regions, *, room: RoomId = 0, generation: int = 0
    ) -> int:
        link = self._own(link, ZmqTcpLink)
        src = self._sources.map(src_regions, (b.src_region for b in plan.batches), "source")
        sizes = {region_id: mapped.nbytes for region_id, mapped in src.items()}
        dst_sizes = link.peer.region_nbytes or None  # checked again by the receiver
        layouts = await asyncio.to_thread(layout_chunks, plan, sizes, self.chunk_nbytes, dst_sizes=dst_sizes)
        xfer = link.open_xfer(wire_room(room))
        gathered = _Prefetch(layouts, src, depth=2)  # gathers run ahead while chunks are on the wire
        total = sum(layout.nbytes for layout in layouts)
        try:
            for index, layout in enumerate(layouts):
                payload = await gathered.next()
                if index and index == len(layouts) - 1:
                    # the receiver scatters large chunks in threads, so a small last chunk
                    # could land first: the plan's last run (a room's aux row) goes only
                    # once the rest has landed
                    await link.wait_acked(xfer)
                await link.acquire(layout.nbytes)
                xfer.unacked[layout.seq] = layout.nbytes
                header = ChunkHeader(xfer.xfer_id, xfer.room, generation, layout.seq, layout.wire)
                await _send(link, [encode(header), payload])
                if xfer.result.done():
                    break  # refused mid-way: stop sending, report the receiver's reason
            if not xfer.result.done():
                await _send(
                    link, [encode(EndHeader(xfer.xfer_id, xfer.room, generation, len(layouts), total))]
                )
            landed = await xfer.result
        finally:
            gathered.cancel()
            await link.close_xfer(xfer)
        if landed != total:
            raise TransportError(
                f"{link.peer.peer_id} acknowledged {landed} of {total} bytes of room {room}",
                code=Reason.TRANSFER_INCOMPLETE,
            )
        link.nbytes_written += total
        link.num_writes += 1
        return total


class _Prefetch:
    """Gathers of the next ``depth`` chunks, each in a worker thread, in order."""

    def __init__(self, layouts: list, src: dict, depth: int) -> None:
        self._layouts, self._src, self._depth = layouts, src, depth
        self._next = 0
        self._pending: deque[asyncio.Future] = deque()

    async def next(self) -> np.ndarray:
        self._top_up()
        payload = await self._pending.popleft()
        self._top_up()
        return payload

    def _top_up(self) -> None:
        while self._next < len(self._layouts) and len(self._pending) < self._depth:
            layout = self._layouts[self._next]
            self._pending.append(asyncio.ensure_future(asyncio.to_thread(gather_chunk, layout, self._src)))
            self._next += 1

    def cancel(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pending.clear()


async def _send(link: ZmqTcpLink, frames: list) -> None:
    try:
        await link.socket.send_multipart(frames, copy=False)
    except zmq.ZMQError as err:
        raise TransportError(
            f"sending to {link.peer.peer_id} failed: {err}", code=Reason.TRANSPORT_FAILED
        ) from None
