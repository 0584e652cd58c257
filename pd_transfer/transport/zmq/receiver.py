"""The ZeroMQ tcp data plane's receiving side (the CURVE variant of :mod:`~pd_transfer.transport.tcp.receiver`).

A ROUTER socket that scatters chunks into regions. One :class:`ZmqTcpReceiver` per decode rank serves every prefill peer. For each
chunk it decodes the header (:mod:`~pd_transfer.transport.tcp.frames`), looks the destination regions
up (``regions_lookup``: region id -> the registered tensor, or None), checks
every run against them (:func:`~pd_transfer.transport.copy.packing.check_wire`), scatters the payload
and acks; after a transfer's ``end`` it answers ``done`` if every chunk
landed. A frame that fails any check is refused with a reason, counted in
:attr:`TcpReceiver.stats`, and never written; the transfer it belongs to is
failed (the sender's ``write`` raises with that reason), and the receiver
keeps serving everyone else. Rooms are admitted as by every receiver
(:class:`~pd_transfer.transport.base.Receiver`: ``expect``, ``forget``, ``fence``).

Frames are read one at a time, in arrival order, and checked before anything
else happens; chunks of ``inline_nbytes`` or more are then scattered in
worker threads, at most ``max_scatters`` at once, while the next frames are
read (acks may go out of order; the sender matches them by sequence number).
A transfer's ``end`` waits for its chunks still landing. After
:meth:`TcpReceiver.fence` returns, no chunk of the fenced room generation can
still land (abort with drain).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from pd_transfer.errors import Reason, TransportError
from pd_transfer.memory import segment_guard as shm_guard
from pd_transfer.transport.base import Receiver
from pd_transfer.transport.copy.packing import check_wire, scatter_chunk
from pd_transfer.transport.receiver_rooms import RoomPolicy, Ticket
from pd_transfer.transport.regions import Mapped, MappedCache, RegionMemory
from pd_transfer.transport.tcp.frames import (
    Ack,
    ChunkHeader,
    EndHeader,
    Fail,
    XferDone,
    decode_data,
    encode,
)
from pd_transfer.transport.tcp.serving import ReceiverStats
from pd_transfer.transport.tcp.xfers import Incoming, XferProgress, check_complete

log = logging.getLogger("pd_transfer.transport.zmq")

RegionLookup = Callable[[str], RegionMemory | None]
LandedCallback = Callable[[str, int, int], None]  # (room, generation, nbytes)


class ZmqTcpReceiver(Receiver):
    """Serve the regions behind ``regions_lookup`` at ``tcp://bind_host:port``.

    ``port=0`` picks a free port; :attr:`address` is the endpoint to publish.
    ``on_landed(room, generation, nbytes)`` is called after each complete
    transfer (before ``done`` goes out). ``watch(socket)``, when given, runs
    as a task of the receiver from bind to stop: the agent follows the
    socket's connections with it (ZeroMQ ends a connection whose frame breaks
    the size limit without telling the application). ``on_bad_frame(reason)``
    hears of every frame refused unread (not ours, or malformed).
    """

    def __init__(
        self,
        bind_host: str,
        regions_lookup: RegionLookup | Mapping[str, RegionMemory],
        *,
        port: int = 0,
        context: zmq.asyncio.Context | None = None,
        max_chunk_nbytes: int = 64 << 20,
        inline_nbytes: int = 256 << 10,
        max_scatters: int = 2,
        on_landed: LandedCallback | None = None,
        socket_options: Callable[[zmq.Socket], None] | None = None,
        policy: RoomPolicy = RoomPolicy.ANY,
        watch: Callable[[zmq.asyncio.Socket], Coroutine[Any, Any, None]] | None = None,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
    ) -> None:
        super().__init__(policy)
        self.socket_options = socket_options  # e.g. CURVE server keys, set by the agent
        self.watch = watch
        self.on_bad_frame = on_bad_frame
        self._watching: asyncio.Task | None = None
        self.bind_host = bind_host
        self.port = port
        self._lookup: RegionLookup = (
            regions_lookup.get if isinstance(regions_lookup, Mapping) else regions_lookup
        )
        self.context = context or zmq.asyncio.Context.instance()
        self.max_chunk_nbytes = max_chunk_nbytes
        self.inline_nbytes = inline_nbytes
        self.on_landed = on_landed
        self.stats = ReceiverStats()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._mapped = MappedCache()
        self._xfers = Incoming(log)
        self._landing: set[asyncio.Future] = set()
        self._slots = asyncio.Semaphore(max_scatters)

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and start serving; return the address peers connect to."""
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        if self.socket_options is not None:
            self.socket_options(socket)
        # a frame larger than a chunk plus its header is dropped by zmq with the connection
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_chunk_nbytes + (16 << 20))
        try:
            socket.bind(f"tcp://{self.bind_host}:{self.port or '*'}")
        except zmq.ZMQError as err:
            socket.close(linger=0)
            raise TransportError(
                f"tcp receiver cannot bind {self.bind_host}:{self.port}: {err}", code=Reason.TRANSPORT_FAILED
            ) from None
        self._socket = socket
        self.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._serve(), name=f"tcp-receiver-{self.address}")
        if self.watch is not None:
            self._watching = asyncio.create_task(
                self.watch(socket), name=f"tcp-receiver-watch-{self.address}"
            )
        return self.address

    async def stop(self) -> None:
        for task in (self._task, self._watching):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._watching = None
        if self._landing:  # let writes already in threads finish before the socket goes
            await asyncio.gather(*list(self._landing), return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _settle(self, room: str, generation: int) -> None:
        """Chunks admitted before the fence may still be scattering in threads: wait for
        them all."""
        if self._landing:
            await asyncio.gather(*list(self._landing), return_exceptions=True)

    # -- serving ----------------------------------------------------------------------
    async def _serve(self) -> None:
        socket = self._socket
        while socket is not None:
            frames = await socket.recv_multipart(copy=False)
            try:
                await self._handle(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one frame stop the receiver
                log.exception("tcp receiver %s: frame handling failed", self.address)
                self.stats.refused[Reason.TRANSPORT_FAILED] += 1

    async def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self.stats.refused[Reason.BAD_FRAME] += 1
            self.on_bad_frame(Reason.BAD_FRAME.value)
            return
        try:
            header = decode_data(frames[1].bytes)
        except TransportError as err:
            log.warning("tcp receiver %s: refused a frame: %s", self.address, err.message)
            self.stats.refused[err.code] += 1
            self.on_bad_frame(err.code.value)
            return
        key = (identity, header.xfer)
        if self._xfers.refused(*key):
            self.stats.refused[Reason.TRANSPORT_FAILED] += 1  # rest of a refused transfer
            return
        try:
            if isinstance(header, ChunkHeader):
                await self._chunk(identity, key, header, frames[2:])
            else:
                await self._end(identity, key, header)
        except TransportError as err:
            await self._refuse(identity, key, header.room, err)

    async def _chunk(
        self, identity: bytes, key: tuple[bytes, int], header: ChunkHeader, payload_frames: list
    ) -> None:
        if len(payload_frames) != 1:
            raise TransportError(
                f"chunk {header.seq} carries {len(payload_frames)} payload frames, not 1",
                code=Reason.BAD_FRAME,
            )
        self.admission.check_fence(header.room, header.generation)
        progress = self._xfers.progress(*key, f"tcp receiver {self.address}")
        payload = np.frombuffer(payload_frames[0].buffer, dtype=np.uint8)
        regions = {region_id: self._region(region_id) for region_id in header.wire.regions}
        check_wire(header.wire, {r: m.nbytes for r, m in regions.items()}, payload.size)
        if payload.size < self.inline_nbytes:
            ticket = self._admit(header)
            before = shm_guard.faults_total()
            try:
                scatter_chunk(header.wire, payload, regions)
                shm_guard.check_landed(before, f"room {header.room} chunk {header.seq}")
            finally:
                self.admission.release(ticket)
            await self._landed(identity, header, progress, int(payload.size))
            return
        # big chunks scatter in threads, a few at a time, while the next frames are read
        await self._slots.acquire()
        try:
            ticket = self._admit(header)  # a fence may have come meanwhile
        except TransportError:
            self._slots.release()
            raise
        task = asyncio.ensure_future(self._land(identity, key, header, payload, regions, progress, ticket))
        progress.landing.add(task)
        self._landing.add(task)

        def settled(done: asyncio.Future[None]) -> None:
            progress.landing.discard(done)
            self._landing.discard(done)
            self._slots.release()

        task.add_done_callback(settled)

    def _admit(self, header: ChunkHeader) -> Ticket:
        return self.admission.admit(header.room, header.generation, header.wire.regions, header.wire.runs)

    async def _land(
        self,
        identity: bytes,
        key: tuple[bytes, int],
        header: ChunkHeader,
        payload: np.ndarray,
        regions: dict[str, Mapped],
        progress: XferProgress,
        ticket: Ticket,
    ) -> None:
        before = shm_guard.faults_total()
        try:
            await asyncio.to_thread(scatter_chunk, header.wire, payload, regions)
            shm_guard.check_landed(before, f"room {header.room} chunk {header.seq}")
        except TransportError as err:  # a segment truncated under the scatter
            await self._refuse(identity, key, header.room, err)
            return
        except Exception as err:  # checked before; a failure here is a bug, not the peer's
            log.exception("tcp receiver %s: scatter failed", self.address)
            await self._refuse(
                identity,
                key,
                header.room,
                TransportError(
                    f"chunk {header.seq} could not be written: {err}", code=Reason.TRANSPORT_FAILED
                ),
            )
            return
        finally:
            self.admission.release(ticket)
        await self._landed(identity, header, progress, int(payload.size))

    async def _landed(
        self, identity: bytes, header: ChunkHeader, progress: XferProgress, nbytes: int
    ) -> None:
        progress.chunks += 1
        progress.nbytes += nbytes
        self.stats.chunks_landed += 1
        self.stats.nbytes_landed += nbytes
        await self._reply(identity, Ack(header.xfer, header.seq, nbytes))

    async def _end(self, identity: bytes, key: tuple[bytes, int], header: EndHeader) -> None:
        self.admission.check_end(header.room, header.generation)
        progress = self._xfers.end(*key)
        if progress.landing:  # chunks still being written in threads
            await asyncio.gather(*list(progress.landing), return_exceptions=True)
            if self._xfers.refused(*key):
                return  # one of them failed; the refusal was sent
        check_complete(progress, header)
        self.stats.transfers_done += 1
        if self.on_landed is not None:
            self.on_landed(header.room, header.generation, header.nbytes)
        await self._reply(identity, XferDone(header.xfer, header.nbytes))

    def _region(self, region_id: str) -> Mapped:
        return self._mapped.destination(self._lookup, region_id)

    async def _refuse(self, identity: bytes, key: tuple[bytes, int], room: str, err: TransportError) -> None:
        log.warning("tcp receiver %s: refused room %s: %s", self.address, room or "-", err.message)
        self.stats.refused[err.code] += 1
        self._xfers.refuse(*key)
        await self._reply(identity, Fail(key[1], err.code.value, err.message))

    async def _reply(self, identity: bytes, message: Ack | XferDone | Fail) -> None:
        if self._socket is None:
            return
        try:
            await self._socket.send_multipart([identity, encode(message)])
        except zmq.ZMQError as err:  # the peer went away; its write will time out
            log.warning("tcp receiver %s: reply lost: %s", self.address, err)
