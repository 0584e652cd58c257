"""The blocking client: one worker thread calls its sidecar and waits for the reply.

Every call sends one request to the sidecar's worker endpoint (a ZeroMQ
DEALER for ``ipc://``, a plain Unix socket for ``unix://``; see
:mod:`pd_transfer.client.links`) and blocks in ``poll`` until the reply with
the same ``id`` arrives or ``timeout_s`` passes (no busy-waiting: the thread
sleeps in the kernel). A reply that arrives after its call timed out is
recognised by its id and dropped, so a timeout never shifts later replies
onto the wrong call. A connection the sidecar closes (``unix://``) or drops
(``ipc://``) fails the call in progress with :class:`SidecarLost` at once.

``wait`` on a room with a doorbell (same host, see
:mod:`pd_transfer.client.bells`) sleeps on its futex word first, and returns
Success without a message when every source rang it.

With a shared secret (see :mod:`pd_transfer.client.auth`) the first call
runs the authentication handshake before its request, within the call's
timeout; a failed handshake raises :class:`AuthFailed`.

A :class:`Client` is not thread-safe (nor is a ZeroMQ socket): use one per
thread, or the :class:`~pd_transfer.client.aio.AsyncClient` for concurrent
calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq

from pd_transfer.client import auth
from pd_transfer.client import calls as wire
from pd_transfer.client.bells import WorkerBells
from pd_transfer.client.errors import ClientClosed, ReplyTimeout, SidecarLost
from pd_transfer.client.links import open_link
from pd_transfer.client.status import RoomState, RoomStatus
from pd_transfer.errors import AuthError, Reason
from pd_transfer.layout.geometry import RankGeometry
from pd_transfer.memory.doorbell import Outcome
from pd_transfer.protocol.worker_api import encode
from pd_transfer.security import ClientHandshake, SharedSecret

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0


class Client:
    """A worker's connection to its sidecar. See the module docstring.

    ``timeout_s`` bounds the wait for each reply; :meth:`wait` adds its own
    ``timeout_s`` to it, since the sidecar holds that reply back on purpose.
    ``secret`` (bytes or str, hex or raw) or ``secret_file`` authenticate the
    worker; without them ``PD_TRANSFER_SECRET_FILE`` or ``PD_TRANSFER_SECRET``
    do, if set.
    """

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        context: zmq.Context | None = None,
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
        self._link = open_link(
            endpoint, context or zmq.Context.instance(), random_id=self._secret is not None
        )
        self._next_id = 1
        self._closed = False
        self._bells = WorkerBells()

    # -- calls ----------------------------------------------------------------------
    def register(
        self,
        geometry: RankGeometry,
        handles: Mapping[str, str],
        *,
        timeout_s: float | None = None,
        pp_size: int = 1,
    ) -> None:
        """Register this rank's geometry; ``handles`` maps every region id to its shm segment.

        Called once, before any send/expect. Raises :class:`Refused` with
        the sidecar's diagnostic when it refuses the registration.
        ``timeout_s`` overrides the reply timeout for this call (a worker
        started together with its sidecar may give it longer to come up).
        """
        self._call(wire.register_request(geometry, handles, self.worker_id, pp_size), timeout_s=timeout_s)

    def send(
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
        """Prefill: hand the sidecar source pages of ``room`` to transfer.

        ``send`` may be called per chunk; pages of successive calls are
        concatenated in order and map positionally onto the decode side's
        pages. State slots, SWA pages and the aux row go with the last chunk
        (``last_chunk=True``). Returns once the sidecar has accepted the chunk,
        not when it has been copied: :meth:`wait` for that.

        ``stream=True`` sends the chunk before its KV is computed: the sidecar
        moves each layer once :meth:`layer_ready` announces it, so the
        transfer overlaps the forward pass. Announce every layer of this
        rank's span for every streamed chunk; state slots, SWA pages and aux
        move after the last chunk's last layer.

        ``decode`` names the decode instance the router paired this request
        with (its sidecars' ``instance_id``): the room's bytes go to that
        instance only, and another decode peer's request for the room is
        refused with ``not_room_owner``. Without it the first decode instance
        whose request arrives owns the room (see docs/security.md).
        """
        self._call(
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

    def expect(
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
        """Decode: announce ``room`` and the destination pages, slots and aux row it fills.

        ``bootstrap_addr`` is the prefill instance's bootstrap address
        (``tcp://host:port``). The pages must stay reserved until the room is
        terminal, or until :meth:`abort` returns True. ``held_pages``: the
        first pages of ``pages`` already hold the room's tokens (a prefix-cache
        hit); nothing is written into them.
        """
        reply = self._call(
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

    def layer_ready(self, room: int, layer_id: int) -> None:
        """Prefill, streaming: layer ``layer_id`` of ``room``'s latest streamed chunk is written.

        Layers may be announced in any order; an id outside this rank's
        layers, or a room with no streamed chunk waiting, is refused.
        """
        self._call(wire.layer_ready_request(room, layer_id))

    def poll(self, room: int) -> RoomState:
        """The room's current status, without waiting for it to change (a rung
        doorbell answers without a message)."""
        request = wire.poll_request(room)
        if self._bells.wait(room, 0.0) is Outcome.RUNG:
            return RoomState(RoomStatus.SUCCESS)
        return self._bells.seen(room, wire.room_state(request["op"], self._call(request)))

    def rang(self, room: int) -> bool | None:
        """What ``room``'s doorbell says, without a message to the sidecar.

        True: every writer rang, the room succeeded. False: the bell is still
        open and nothing was decided. None: only the sidecar can tell (the room
        has no doorbell, or the sidecar closed its slot: ``poll`` it). For a
        caller that polls often: a False costs a memory read, not a round trip;
        poll now and then all the same, since a sidecar that died closes no slot.
        """
        outcome = self._bells.wait(room, 0.0)
        if outcome is Outcome.RUNG:
            return True
        return False if outcome is Outcome.TIMEOUT else None

    def wait(self, room: int, timeout_s: float) -> RoomState:
        """Block until ``room`` is terminal or ``timeout_s`` passes; the status either way.

        A room with a doorbell (same host, see :mod:`pd_transfer.client.bells`)
        is waited for on it first: Success then comes without a message.
        """
        wire.wait_request(room, timeout_s)  # the arguments checked before any sleep
        deadline = time.monotonic() + timeout_s
        try:
            outcome = self._bells.wait(room, timeout_s, alive=self._link.alive)
        except ConnectionError as err:
            raise self._lost("wait", err) from None
        if outcome is Outcome.RUNG:
            return RoomState(RoomStatus.SUCCESS)
        if outcome is not None:  # closed or timed out: the sidecar has the rest of the time
            timeout_s = max(0.0, deadline - time.monotonic())
        request = wire.wait_request(room, timeout_s)
        reply = self._call(request, timeout_s=timeout_s + self.timeout_s)
        return self._bells.seen(room, wire.room_state(request["op"], reply))

    def abandon(self, room: int, bootstrap_addr: str, reason: str) -> None:
        """Decode: ``room`` from ``bootstrap_addr`` will never be expected (its request ended
        first, or cannot be loaded). The sidecar tells that prefill instance, whose room fails
        with ``reason`` at once instead of waiting for a claim until its bootstrap timeout."""
        self._call(wire.abandon_request(room, bootstrap_addr, reason))

    def abort(self, room: int) -> bool:
        """Abort ``room``. True (drained): no write can land any more, the pages are free."""
        request = wire.abort_request(room)
        self._bells.forget(room)
        return wire.drained(request["op"], self._call(request))

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Close the socket; later calls raise :class:`ClientClosed`. Idempotent."""
        if not self._closed:
            self._closed = True
            self._link.close()
            self._bells.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------
    def _call(self, request: wire.Request, timeout_s: float | None = None) -> dict[str, Any]:
        op = request["op"]
        if self._closed:
            raise ClientClosed(op)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        request_id = self._next_id
        self._next_id += 1
        self._prepare(op, deadline, timeout_s)
        if not self._authenticated and self._secret is not None:
            self._authenticate(self._secret, op, deadline, timeout_s)
        self._send(encode({**request, "id": request_id}), op, deadline, timeout_s)
        while True:
            got_id, reply = wire.reply_id(self._receive(op, deadline, timeout_s))
            if got_id == request_id and reply is not None:
                if self._secret is not None and reply.get("code") == Reason.UNAUTHENTICATED.value:
                    self._authenticated = False  # the sidecar restarted: the next call proves again
                return wire.checked(op, reply)
            log.debug(
                "worker %s dropped a reply with id %s while waiting for %s id %d "
                "(a call that timed out earlier)",
                self.worker_id,
                got_id,
                op,
                request_id,
            )

    def _authenticate(self, secret: SharedSecret, op: str, deadline: float, timeout_s: float) -> None:
        handshake = ClientHandshake(secret, self.worker_id, peer=f"the sidecar at {self.endpoint}")
        outgoing: bytes | None = handshake.hello()
        try:
            while not handshake.done:
                if outgoing is not None:
                    self._send(outgoing, op, deadline, timeout_s)
                frame = self._receive(op, deadline, timeout_s)
                try:
                    outgoing = auth.step(handshake, frame)
                except AuthError as err:
                    if err.reply is not None:
                        self._link.send_nowait(err.reply)
                    raise auth.failed(op, err) from None
        except ReplyTimeout:
            # a late answer to this handshake would derail the next one: retry on a new connection
            self._link.reset()
            raise
        self._authenticated = True

    def _prepare(self, op: str, deadline: float, timeout_s: float) -> None:
        if self._on_link(self._link.prepare, op, deadline, timeout_s):
            self._authenticated = self._secret is None  # a new connection proves itself again

    def _send(self, frame: bytes, op: str, deadline: float, timeout_s: float) -> None:
        self._on_link(lambda until: self._link.send(frame, until), op, deadline, timeout_s)

    def _receive(self, op: str, deadline: float, timeout_s: float) -> bytes:
        return self._on_link(self._link.receive, op, deadline, timeout_s)

    def _on_link(self, step, op: str, deadline: float, timeout_s: float):
        """``step(deadline)`` on the link: SidecarLost if the connection is lost,
        ReplyTimeout if it returns None (nothing before the deadline)."""
        try:
            result = step(deadline)
        except ConnectionError as err:
            raise self._lost(op, err) from None
        if result is None:
            raise ReplyTimeout(op, timeout_s, self.endpoint)
        return result

    def _lost(self, op: str, err: ConnectionError) -> SidecarLost:
        self._authenticated = self._secret is None  # a new connection proves itself again
        return SidecarLost(op, str(err))
