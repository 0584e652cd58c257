"""The asyncio client: the same calls as :class:`~pd_transfer.client.sync.Client`, awaited.

Many calls may be in flight at once (a decode worker ``wait``s on every room
of its window concurrently): each request carries a fresh ``id`` and one
reader task routes every reply to the future of its call. A call whose reply
does not come within its timeout raises :class:`ReplyTimeout`; its late reply
is dropped by id. With a shared secret, the first call runs the
authentication handshake (once, however many calls start together).

Uses ``zmq.asyncio`` (``ipc://``) or asyncio streams (``unix://``) on the
running event loop; see :mod:`pd_transfer.client.links`. The one thread: a room with
a doorbell (same host) is awaited through a watcher thread per doorbell
segment that sleeps on all of them at once (:mod:`pd_transfer.client.bells`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from pd_transfer.client import auth
from pd_transfer.client import calls as wire
from pd_transfer.client.bells import WorkerBells
from pd_transfer.client.errors import ClientClosed, ReplyTimeout, SidecarLost
from pd_transfer.client.links import open_async_link
from pd_transfer.client.status import RoomState, RoomStatus
from pd_transfer.client.sync import DEFAULT_TIMEOUT_S
from pd_transfer.errors import AuthError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.memory.doorbell import Outcome
from pd_transfer.protocol.worker_api import encode
from pd_transfer.security import ClientHandshake, SharedSecret

log = logging.getLogger(__name__)


class AsyncClient:
    """A worker's connection to its sidecar, for asyncio workers.

    The contract of every call is that of the blocking
    :class:`~pd_transfer.client.sync.Client` method of the same name.
    """

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        context: zmq.asyncio.Context | None = None,
        secret: bytes | str | None = None,
        secret_file: str = "",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.timeout_s = float(timeout_s)
        self._secret = auth.client_secret(secret, secret_file)
        self._authenticated = self._secret is None
        self._auth_lock = asyncio.Lock()
        self._handshake_frames: asyncio.Queue[bytes] | None = None  # while a handshake runs
        self._link = open_async_link(
            endpoint, context or zmq.asyncio.Context.instance(), random_id=self._secret is not None
        )
        self._next_id = 1
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._gone: asyncio.Future | None = None  # resolved once the reader loses the connection
        self._closed = False
        self._bells = WorkerBells()

    # -- calls ----------------------------------------------------------------------
    async def register(
        self,
        geometry: RankGeometry,
        handles: Mapping[str, str],
        *,
        timeout_s: float | None = None,
        pp_size: int = 1,
    ) -> None:
        await self._call(
            wire.register_request(geometry, handles, self.worker_id, pp_size), timeout_s=timeout_s
        )

    async def send(
        self,
        room: int,
        pages,
        *,
        state_slots=(),
        aux_row: int | None = None,
        last_chunk: bool = True,
        swa_pages=(),
        stream: bool = False,
        decode: str = "",
    ) -> None:
        """Prefill chunk; see :meth:`Client.send <pd_transfer.client.sync.Client.send>`.

        ``send`` may be called per chunk; pages of successive calls are
        concatenated in order and map positionally onto the decode side's
        pages. State, SWA pages and aux go with the last chunk.
        """
        await self._call(
            wire.send_request(
                room,
                pages,
                state_slots=state_slots,
                aux_row=aux_row,
                last_chunk=last_chunk,
                swa_pages=swa_pages,
                stream=stream,
                decode=decode,
            )
        )

    async def expect(
        self,
        room: int,
        bootstrap_addr: str,
        pages,
        *,
        state_slots=(),
        aux_row: int | None = None,
        swa_pages=(),
        held_pages: int = 0,
    ) -> None:
        reply = await self._call(
            wire.expect_request(
                room,
                bootstrap_addr,
                pages,
                state_slots=state_slots,
                aux_row=aux_row,
                swa_pages=swa_pages,
                held_pages=held_pages,
            )
        )
        self._bells.note(room, reply)

    async def layer_ready(self, room: int, layer_id: int) -> None:
        await self._call(wire.layer_ready_request(room, layer_id))

    async def poll(self, room: int) -> RoomState:
        request = wire.poll_request(room)
        if self._bells.wait(room, 0.0) is Outcome.RUNG:
            return RoomState(RoomStatus.SUCCESS)
        return self._bells.seen(room, wire.room_state(request["op"], await self._call(request)))

    async def wait(self, room: int, timeout_s: float) -> RoomState:
        wire.wait_request(room, timeout_s)  # the arguments checked before any sleep
        deadline = time.monotonic() + timeout_s
        try:
            outcome = await self._bells.wait_async(room, timeout_s, gone=self._gone)
        except ConnectionError as err:
            raise self._lost("wait", err) from None
        if outcome is Outcome.RUNG:
            return RoomState(RoomStatus.SUCCESS)
        if outcome is not None:  # closed or timed out: the sidecar has the rest of the time
            timeout_s = max(0.0, deadline - time.monotonic())
        request = wire.wait_request(room, timeout_s)
        reply = await self._call(request, timeout_s=timeout_s + self.timeout_s)
        return self._bells.seen(room, wire.room_state(request["op"], reply))

    async def abandon(self, room: int, bootstrap_addr: str, reason: str) -> None:
        """Decode: ``room`` from ``bootstrap_addr`` will never be expected (its request ended
        first, or cannot be loaded). The sidecar tells that prefill instance, whose room fails
        with ``reason`` at once instead of waiting for a claim until its bootstrap timeout."""
        await self._call(wire.abandon_request(room, bootstrap_addr, reason))

    async def abort(self, room: int) -> bool:
        request = wire.abort_request(room)
        self._bells.forget(room)
        return wire.drained(request["op"], await self._call(request))

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Close the socket; calls in flight and later calls raise :class:`ClientClosed`."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None and not self._reader.get_loop().is_closed():
            self._reader.cancel()  # (after its loop closed, nothing runs or awaits it any more)
            for request_id, future in list(self._pending.items()):
                if not future.done():
                    future.set_exception(ClientClosed(f"call {request_id}"))
        self._pending.clear()
        self._link.close()
        self._bells.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    # -- plumbing -----------------------------------------------------------------------
    async def _call(self, request: wire.Request, timeout_s: float | None = None) -> dict[str, Any]:
        op = request["op"]
        if self._closed:
            raise ClientClosed(op)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._reader is None or self._reader.done():
            self._gone = asyncio.get_running_loop().create_future()
            self._reader = asyncio.get_running_loop().create_task(self._read_replies())
        request_id = self._next_id
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with asyncio.timeout(timeout_s):
                if not self._authenticated and self._secret is not None:
                    await self._authenticate(self._secret, op)
                await self._link.send(encode({**request, "id": request_id}))
                reply = await future
        except TimeoutError:
            raise ReplyTimeout(op, timeout_s, self.endpoint) from None
        except ConnectionError as err:
            raise self._lost(op, err) from None
        except ClientClosed:
            raise ClientClosed(op) from None
        finally:
            self._pending.pop(request_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # failed by the reader after this call failed itself: seen
        if self._secret is not None and reply.get("code") == Reason.UNAUTHENTICATED.value:
            self._authenticated = False  # the sidecar restarted: the next call proves again
        return wire.checked(op, reply)

    async def _authenticate(self, secret: SharedSecret, op: str) -> None:
        async with self._auth_lock:
            if self._authenticated:
                return  # another call did it while this one waited
            handshake = ClientHandshake(secret, self.worker_id, peer=f"the sidecar at {self.endpoint}")
            self._handshake_frames = asyncio.Queue()
            try:
                outgoing: bytes | None = handshake.hello()
                while not handshake.done:
                    if outgoing is not None:
                        await self._link.send(outgoing)
                    try:
                        outgoing = auth.step(handshake, await self._handshake_frames.get())
                    except AuthError as err:
                        if err.reply is not None:
                            await self._link.send(err.reply)
                        raise auth.failed(op, err) from None
            except asyncio.CancelledError:
                # timed out: a late answer would derail the next handshake, so that one
                # starts on a new connection, with a new reader
                if self._reader is not None:
                    self._reader.cancel()
                    self._reader = None
                self._link.reset()
                raise
            finally:
                self._handshake_frames = None
            self._authenticated = True

    async def _read_replies(self) -> None:
        """Route every reply to the future of its call, until the client closes (or a
        connection is lost: every call in flight then fails with SidecarLost)."""
        while not self._closed:
            try:
                frame = await self._link.receive()
            except asyncio.CancelledError:
                break
            except ConnectionError as err:
                self._authenticated = self._secret is None  # a new connection proves itself again
                if self._gone is not None and not self._gone.done():
                    self._gone.set_result(err)
                for pending in list(self._pending.values()):
                    if not pending.done():
                        pending.set_exception(err)
                break
            got_id, reply = wire.reply_id(frame)
            if self._handshake_frames is not None and (got_id is None or got_id < 0):
                self._handshake_frames.put_nowait(frame)
                continue
            future = self._pending.get(got_id) if got_id is not None else None
            if future is None or future.done():
                log.debug(
                    "worker %s dropped a reply with id %s (no call waits for it)", self.worker_id, got_id
                )
                continue
            future.set_result(reply)

    def _lost(self, op: str, err: ConnectionError) -> SidecarLost:
        self._authenticated = self._secret is None
        return SidecarLost(op, str(err))
