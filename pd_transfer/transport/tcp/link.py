"""One tcp sender link: a plain TCP connection to a peer's receiver, driven by two threads.

The event loop side (``write`` in :mod:`~pd_transfer.transport.tcp.transport`) takes
window credit and queues jobs (a chunk to send, a transfer's end); everything that
blocks runs in the link's threads:

- the *sender* thread connects (retrying every 0.1-1 s while the peer is not there,
  as ZeroMQ did), runs the authentication handshake, then takes jobs in order: it
  encodes each chunk's header and ``sendmsg``-s it with the payload as memoryviews of
  the source regions (:mod:`~pd_transfer.transport.tcp.iovecs`);
- the *reader* thread of each connection reads the receiver's replies (ack, done,
  fail) and hands them to the loop with ``call_soon_threadsafe``.

Blocking socket calls release the GIL, so the two copies of a payload (into the
kernel here, out of it in the receiver) run while Python waits.

A transfer lives on one connection (the receiver counts its chunks there): if the
connection breaks, every transfer on it fails with TRANSPORT_FAILED and the next
write reconnects. Jobs of a transfer that finished or was abandoned (its caller timed
out) are skipped, not sent; the one chunk the sender thread may be sending at that
moment is not waited for by :meth:`Link.drain` (a stalled receiver could hold it
forever): as with any bytes already in the network, the decode receiver's fence is
what keeps a late chunk of an aborted room out
(:meth:`~pd_transfer.transport.tcp.receiver.TcpReceiver.fence`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pd_transfer.errors import Reason, TransportError
from pd_transfer.transport.base import Link, PeerEndpoint
from pd_transfer.transport.copy.packing import ChunkLayout
from pd_transfer.transport.regions import Mapped
from pd_transfer.transport.tcp.frames import Ack, ChunkHeader, EndHeader, Fail, XferDone, decode_reply, encode
from pd_transfer.transport.tcp.iovecs import DIRECT_MIN_NBYTES, Staging, source_parts
from pd_transfer.transport.tcp.sockets import (
    Authenticator,
    FrameChannel,
    Kind,
    PeerClosed,
    configure,
    prefix,
    read_prefix,
    recv_exact,
    send_frame,
    send_part,
    shutdown,
)
from pd_transfer.transport.tcp.xfers import Xfer, settle

log = logging.getLogger("pd_transfer.transport.tcp.transport")

MAX_REPLY_NBYTES = 16 << 10
_RETRY_MIN_S, _RETRY_MAX_S = 0.1, 1.0
_AUTH_RETRY_S = 1.0  # a refused handshake fails writes at once for this long, then retries


@dataclass
class LinkOptions:
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0
    direct_min_nbytes: int = DIRECT_MIN_NBYTES
    auth: Authenticator | None = None


@dataclass
class _Job:
    xfer: Xfer
    layout: ChunkLayout | None = None
    src: Mapping[str, Mapped] | None = None
    end: EndHeader | None = None


class TcpLink(Link):
    def __init__(
        self,
        transport,
        peer: PeerEndpoint,
        address: tuple[str, int],
        window_nbytes: int,
        options: LinkOptions,
    ) -> None:
        super().__init__(transport, peer)
        self.address = address
        self.window_nbytes = window_nbytes
        self.options = options
        self.in_flight_nbytes = 0
        self.max_in_flight_nbytes = 0
        self._loop = asyncio.get_running_loop()
        self._waiters: list[asyncio.Future] = []
        self._xfers: dict[int, Xfer] = {}
        self._ids = itertools.count(1)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sock: socket.socket | None = None
        self._conn_id = 0
        self._auth_error: tuple[float, TransportError] | None = None
        self._readers: list[tuple[socket.socket, threading.Thread]] = []
        self.lanes: list[TcpLink] = [self]  # this link's connections: itself, then the others
        self._sender = self._start_thread(self._send_loop, f"pdt-tcp-send-{peer.peer_id}")

    # -- the loop's side ----------------------------------------------------------------
    def open_xfer(self, room: str, generation: int = 0) -> Xfer:
        xfer = Xfer(next(self._ids), room, generation)
        self._xfers[xfer.xfer_id] = xfer
        return xfer

    def close_xfer(self, xfer: Xfer) -> None:
        """Forget a finished or abandoned write; give back the credit its chunks hold."""
        self._xfers.pop(xfer.xfer_id, None)
        xfer.abandoned = True  # its jobs still queued are skipped
        if xfer.unacked:
            self._give_back(sum(xfer.unacked.values()))
            xfer.unacked.clear()

    def submit_chunk(self, xfer: Xfer, layout: ChunkLayout, src: Mapping[str, Mapped]) -> None:
        xfer.unacked[layout.seq] = layout.nbytes
        self._submit(_Job(xfer, layout=layout, src=src))

    def submit_end(self, xfer: Xfer, end: EndHeader) -> None:
        self._submit(_Job(xfer, end=end))

    def _submit(self, job: _Job) -> None:
        self.check_open()
        self._jobs.put(job)

    async def acquire(self, nbytes: int) -> None:
        """Wait for window credit (a chunk larger than the window goes alone)."""
        while not (
            self._closed or self.in_flight_nbytes == 0 or self.in_flight_nbytes + nbytes <= self.window_nbytes
        ):
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.check_open()
        self.in_flight_nbytes += nbytes
        self.max_in_flight_nbytes = max(self.max_in_flight_nbytes, self.in_flight_nbytes)

    def _give_back(self, nbytes: int) -> None:
        self.in_flight_nbytes -= nbytes
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _dispatch(self, reply: Ack | XferDone | Fail) -> None:
        nbytes = settle(self._xfers, reply, self.peer.peer_id)
        if nbytes is not None:
            self._give_back(nbytes)

    def _fail(self, error: TransportError, conn_id: int | None = None, xfer: Xfer | None = None) -> None:
        """Fail one transfer, the transfers of one connection, or (both None) all of them."""
        for candidate in [xfer] if xfer is not None else list(self._xfers.values()):
            if candidate.abandoned or (conn_id is not None and candidate.conn_id != conn_id):
                continue  # (an abandoned write's error would never be read)
            if not candidate.result.done():
                candidate.result.set_exception(error)

    async def _release(self) -> None:
        for lane in self.lanes[1:]:  # the link's other connections go with it
            lane._closed = True
            await lane._release()
        self._stopping.set()
        self._jobs.put(None)
        with self._lock:
            sock = self._sock
        if sock is not None:
            shutdown(sock)
        await asyncio.to_thread(self._join)
        self._fail(
            TransportError(
                f"link to {self.peer.peer_id} closed with transfers in flight", code=Reason.LINK_CLOSED
            )
        )
        self._give_back(0)  # wake writers waiting for credit: they see the link closed

    def _join(self) -> None:
        self._sender.join()  # it may have connected after _release looked: shut every socket
        for sock, _ in self._readers:
            shutdown(sock)
        for sock, reader in self._readers:
            reader.join()
            sock.close()
        self._readers.clear()

    # -- the sender thread ----------------------------------------------------------------
    @staticmethod
    def _start_thread(target, name: str, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    def _send_loop(self) -> None:
        staging = Staging()
        while (job := self._jobs.get()) is not None:
            try:
                self._run_job(job, staging)
            except Exception as err:  # never let one job stop the link
                log.exception("link %s: sending failed", self.peer.peer_id)
                self._call(
                    self._fail,
                    TransportError(
                        f"sending to {self.peer.peer_id} failed: {err}", code=Reason.TRANSPORT_FAILED
                    ),
                    None,
                    job.xfer,
                )

    def _run_job(self, job: _Job, staging: Staging) -> None:
        xfer = job.xfer
        if xfer.abandoned or xfer.result.done():
            return
        sock = self._connection(xfer)
        if sock is None:
            return
        if xfer.conn_id is None:
            xfer.conn_id = self._conn_id
        elif xfer.conn_id != self._conn_id:
            return  # its connection broke: the transfer has failed already
        try:
            if job.end is not None:
                send_frame(sock, Kind.DATA, encode(job.end))
            elif job.layout is not None and job.src is not None:  # (a job is an end or a chunk)
                self._send_chunk(sock, xfer, job.layout, job.src, staging)
        except OSError as err:
            self._hear_out(sock)
            self._lost(self._conn_id, sock, f"sending to {self.peer.peer_id} failed: {err}")

    def _hear_out(self, sock: socket.socket, timeout_s: float = 1.0) -> None:
        """A receiver that refuses a connection says why before closing it: give that
        socket's reader a moment to deliver the reason (unauthenticated, a refused room)
        before the broken pipe fails the transfers with a bare transport_failed."""
        for reader_sock, reader in list(self._readers):
            if reader_sock is sock:
                reader.join(timeout_s)

    def _send_chunk(
        self,
        sock: socket.socket,
        xfer: Xfer,
        layout: ChunkLayout,
        src: Mapping[str, Mapped],
        staging: Staging,
    ) -> None:
        header = encode(ChunkHeader(xfer.xfer_id, xfer.room, xfer.generation, layout.seq, layout.wire))
        head = np.frombuffer(prefix(Kind.DATA, len(header), layout.nbytes) + header, np.uint8)
        # the prefix and header go with the first part: one system call
        for part in source_parts(layout, src, staging, self.options.direct_min_nbytes, head=head):
            send_part(sock, part)

    def _connection(self, xfer: Xfer) -> socket.socket | None:
        """The live connection, connecting (and retrying) first; None to skip the job."""
        delay = _RETRY_MIN_S
        while True:
            with self._lock:
                if self._sock is not None:
                    return self._sock
            if self._stopping.is_set() or xfer.abandoned:
                return None
            if self._auth_error is not None and time.monotonic() - self._auth_error[0] < _AUTH_RETRY_S:
                self._call(self._fail, self._auth_error[1], None, xfer)
                return None
            self._close_retired()
            try:
                sock = self._connect()
            except TransportError as err:  # the handshake was refused: retrying will not help now
                self._auth_error = (time.monotonic(), err)
                self._call(self._fail, err, None, xfer)
                return None
            except OSError as err:
                log.debug(
                    "link %s: connecting to %s failed: %s", self.peer.peer_id, self.peer.data_address, err
                )
                self._stopping.wait(delay)
                delay = min(2 * delay, _RETRY_MAX_S)
                continue
            self._auth_error = None
            with self._lock:  # _release sets _stopping, then looks at _sock under this lock
                if self._stopping.is_set():
                    sock.close()
                    return None
                self._sock = sock
                self._conn_id += 1
                conn_id = self._conn_id
            self._readers.append(
                (
                    sock,
                    self._start_thread(
                        self._read_loop, f"pdt-tcp-replies-{self.peer.peer_id}", sock, conn_id
                    ),
                )
            )
            return sock

    def _close_retired(self) -> None:
        """Close the sockets of broken connections whose reader has finished (sender thread
        only: a socket is never closed while another thread may be inside a call on it)."""
        live = []
        for sock, reader in self._readers:
            if reader.is_alive():
                live.append((sock, reader))
            else:
                sock.close()
        self._readers = live

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.options.connect_timeout_s)
        try:
            configure(sock)
            if self.options.auth is not None:
                sock.settimeout(self.options.handshake_timeout_s)
                self.options.auth.client(
                    FrameChannel(sock), f"{self.peer.peer_id} ({self.peer.data_address})"
                )
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    # -- the reader threads --------------------------------------------------------------
    def _read_loop(self, sock: socket.socket, conn_id: int) -> None:
        why, clean = "closed by the receiver", True
        try:
            while (
                head := read_prefix(sock, max_header_nbytes=MAX_REPLY_NBYTES, max_payload_nbytes=0)
            ) is not None:
                body = recv_exact(sock, head.header_nbytes)
                if head.kind is not Kind.REPLY:
                    log.warning(
                        "link %s: a %s frame from the receiver dropped", self.peer.peer_id, head.kind.name
                    )
                    continue
                try:
                    reply = decode_reply(body)
                except TransportError as err:
                    log.warning("link %s: unreadable reply dropped: %s", self.peer.peer_id, err)
                    continue
                self._call(self._dispatch, reply)
        except (OSError, TransportError) as err:
            if not isinstance(err, PeerClosed):
                why, clean = str(err), False
        self._lost(conn_id, sock, f"connection to {self.peer.peer_id} lost: {why}", clean)

    def _lost(self, conn_id: int, sock: socket.socket, text: str, clean: bool = False) -> None:
        with self._lock:
            current = self._sock is sock
            if current:
                self._sock = None
        if not current:
            return
        shutdown(sock)  # wakes the other thread; the sender thread closes it later
        code = Reason.LINK_CLOSED if self._stopping.is_set() else Reason.TRANSPORT_FAILED
        if code is Reason.TRANSPORT_FAILED:
            # an idle connection the receiver closed cleanly (its sidecar stopped) is news:
            # nothing was lost, the next write reconnects, and the control channel reports
            # a peer that stays away; bytes in flight or a broken socket are an alarm
            idle = clean and self.in_flight_nbytes == 0
            log.log(
                logging.INFO if idle else logging.WARNING,
                "link %s: %s%s",
                self.peer.peer_id,
                text,
                " (idle; the next write reconnects)" if idle else "",
            )
        self._call(self._fail, TransportError(text, code=code), conn_id)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more
