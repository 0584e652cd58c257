"""The rank table: prefill rank 0 serves it, everyone else asks.

Every prefill rank's sidecar announces itself (geometry, control address,
host) to rank 0's bootstrap socket. Decode sidecars, and the prefill ranks
themselves, ask for the table and get it back, with how many ranks are
expected; callers retry until it is complete or their deadline passes.
An announcement from a rank already listed replaces it (a restarted sidecar
comes back with a new address), so nobody keeps a stale endpoint.

When rank 0's worker is gone (:meth:`BootstrapServer.worker_lost`) the server
keeps its socket and keeps authenticating, so a wrong secret is still refused
and counted; whoever passes gets a Close with ``worker_lost`` saying so, at
once, instead of no answer until its deadline. Announcements are still
recorded, so the table is complete as soon as the worker registers again
(:meth:`BootstrapServer.worker_back`).

With authentication on, both ends run the handshake first
(:mod:`pd_transfer.agent.auth`); the server answers a request sent without it
with a Close, which :func:`fetch_table` turns into an error at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pd_transfer.agent.auth import (
    REFUSAL_LINGER_MS,
    Doorman,
    Security,
    authenticate,
    close_reply,
    peer_key,
    security_of,
    source_fd,
)
from pd_transfer.agent.refusals import first_answer_or_refusal, watch_refusals
from pd_transfer.agent.zmq_bounds import CONTROL_QUEUED_FRAMES, ConnectionWatch, bound_frames
from pd_transfer.errors import AuthError, PdTransferError, ProtocolError, Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.protocol import Announce, Close, RankEntry, RankTable, TableRequest, decode, encode
from pd_transfer.wire.fields import clip_text

log = logging.getLogger(__name__)


class BootstrapServer:
    """Rank 0's table of prefill ranks, served on its own ROUTER."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        address: str,
        on_bad_frame: Callable[[str], None] = lambda reason: None,
        on_closed: Callable[[str], None] = lambda socket: None,
    ) -> None:
        self._on_bad_frame = on_bad_frame
        security = security_of(context)
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        bound_frames(
            self.socket, queued_frames=CONTROL_QUEUED_FRAMES, handshake_timeout_s=security.lobby.timeout_s
        )
        security.listening(self.socket, identified=True)
        try:
            self.socket.bind(address)
        except zmq.ZMQError:
            self.socket.close(linger=0)
            raise
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.entries: dict[tuple[int, int], RankEntry] = {}
        self.expected = 0
        self.bad_frames = 0
        self.gone = ""  # while rank 0's worker is gone: why (the refusal's text)
        self._security = security
        door = security.lobby.door("bootstrap", active=security.enabled)  # agent/lobby.py
        door.bound(self.address)
        self._doorman = Doorman(
            self.socket,
            security,
            f"bootstrap {self.address}",
            close_reply,
            on_bad_frame=self._count_bad_frame,
            door=door,
            identified=True,
        )
        self.watch = ConnectionWatch(
            self.socket,
            "bootstrap",
            f"bootstrap {self.address}",
            on_closed=on_closed,
            on_bad_frame=self._count_bad_frame,
            on_accepted=door.accepted,
            on_disconnected=door.disconnected,
        )

    def _count_bad_frame(self, reason: str) -> None:
        self.bad_frames += 1
        self._on_bad_frame(reason)

    def add(self, entry: RankEntry) -> None:
        key = (entry.geometry.pp_rank, entry.geometry.tp_rank)
        self.entries[key] = entry
        self.expected = entry.geometry.tp_size * entry.pp_size

    def _announced(self, entry: RankEntry) -> None:
        """Ranks announce themselves every few seconds: a new or changed entry is news
        (info), the same one again is not (debug)."""
        known = self.entries.get((entry.geometry.pp_rank, entry.geometry.tp_rank))
        self.add(entry)
        level = logging.DEBUG if known == entry else logging.INFO
        log.log(
            level,
            "bootstrap: %s %s at %s (%d/%d ranks)",
            entry.geometry.rank_id,
            "announced" if known is None else "announced again" if known == entry else "changed",
            entry.control_address,
            len(self.entries),
            self.expected,
        )

    def worker_lost(self, why: str) -> None:
        """Rank 0's worker is gone: refuse the table with ``why`` until it is back, and
        forget the ranks (they announce again; a rank restarted meanwhile is not kept)."""
        self.gone = why
        self.entries.clear()
        self.expected = 0

    def worker_back(self) -> None:
        self.gone = ""

    def table(self) -> RankTable:
        entries = tuple(self.entries[k] for k in sorted(self.entries))
        return RankTable(expected=self.expected, entries=entries)

    async def serve(self) -> None:
        watching = asyncio.create_task(self.watch.run())
        try:
            await self._serve()
        finally:
            watching.cancel()

    async def _serve(self) -> None:
        while True:
            parts = await self.socket.recv_multipart(copy=False)
            if len(parts) != 2:
                self._count_bad_frame(Reason.BAD_FRAME.value)
                continue
            identity, frame, fd = parts[0].bytes, parts[1].bytes, source_fd(parts[1])
            self.watch.drain()  # the connection's ends heard first: a late frame is still judged
            if not await self._doorman.admit(identity, frame, fd, peer_key(parts[1])):
                continue
            try:
                message = decode(frame)
            except ProtocolError as err:
                self._count_bad_frame(err.code.value)
                log.warning("bootstrap: bad frame: %s", err)
                if err.code is Reason.UNKNOWN_MESSAGE:  # e.g. a handshake, with auth off here
                    await self.socket.send_multipart(
                        [identity, encode(Close(reason=err.code, reason_text=clip_text(err.message)))]
                    )
                continue
            if isinstance(message, Announce):
                if not await self._may_announce(identity, fd, message.entry):
                    continue
                self._announced(message.entry)
            elif not isinstance(message, TableRequest):
                self._count_bad_frame(Reason.ILLEGAL_MESSAGE.value)
                continue
            if self.gone:
                refusal = Close(reason=Reason.WORKER_LOST, reason_text=clip_text(self.gone))
                await self.socket.send_multipart([identity, encode(refusal)])
                continue
            await self.socket.send_multipart([identity, encode(self.table())])

    async def _may_announce(self, identity: bytes, fd: int | None, entry: RankEntry) -> bool:
        """With identities checked, only a prefill's key may add a rank to the table, only
        under its own agent id, and naming no other key than its own for its control port."""
        who = self._doorman.proven_identity(identity)
        if who is None or (
            who.role == Role.PREFILL.value
            and entry.agent_id == who.agent_id
            and (
                not entry.control_key
                or (self._security.settings.identities or {}).get(entry.control_key) is who
            )
        ):
            return True
        wrong_key = who.role == Role.PREFILL.value and entry.agent_id == who.agent_id  # all else right
        error = AuthError(
            f"{who.agent_id}: a {who.role} identity announced prefill rank "
            f"{entry.geometry.rank_id} of agent {entry.agent_id!r}"
            + (" naming another control key than its own" if wrong_key else ""),
            code=Reason.IDENTITY_MISMATCH,
        )
        self._security.failed(error, f"bootstrap {self.address}")
        await self.socket.send_multipart(
            [identity, encode(Close(reason=error.code, reason_text=error.message))]
        )
        self._doorman.revoke(identity, fd)
        return False

    def close(self) -> None:
        self.socket.close(linger=0)


async def fetch_table(
    context: zmq.asyncio.Context,
    address: str,
    agent_id: str,
    timeout_s: float,
    announce: RankEntry | None = None,
    poll_interval_s: float = 0.05,
    until_complete: bool = True,
    refused_after_s: float = 0.0,
) -> RankTable:
    """Ask ``address`` for the rank table until it is complete or ``timeout_s`` passes.

    ``until_complete`` False returns the first table: with ``announce``, proof
    that rank 0 has recorded this rank. ``refused_after_s`` > 0 fails sooner when
    every connection to ``address`` was refused that long (:mod:`.refusals`).
    """
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    bound_frames(socket)
    security = security_of(context)
    security.connecting(socket)
    monitor = watch_refusals(socket) if refused_after_s > 0 else None
    socket.connect(address)
    asked = _ask(socket, security, address, agent_id, timeout_s, announce, poll_interval_s, until_complete)
    try:
        if monitor is None:
            return await asked
        return await first_answer_or_refusal(asked, monitor, address, refused_after_s, "bootstrap")
    finally:
        socket.close(linger=0)


async def _ask(
    socket: zmq.asyncio.Socket,
    security: Security,
    address: str,
    agent_id: str,
    timeout_s: float,
    announce: RankEntry | None,
    poll_interval_s: float,
    until_complete: bool,
) -> RankTable:
    deadline = time.monotonic() + timeout_s
    last = RankTable(expected=0)
    if security.enabled:
        await _authenticate(socket, security, address, deadline, timeout_s)
    request = Announce(entry=announce) if announce else TableRequest(agent_id=agent_id)
    while True:
        await socket.send(encode(request))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if await socket.poll(min(remaining, 1.0) * 1000):
            try:
                reply = decode(await socket.recv())
            except ProtocolError as err:
                raise PdTransferError(
                    f"bootstrap {address} sent a bad frame: {err}", code=Reason.BOOTSTRAP_FAILED
                ) from None
            if isinstance(reply, Close):
                raise PdTransferError(
                    f"bootstrap {address} refused the request: {reply.reason_text or 'no reason given'}",
                    code=reply.reason or Reason.BOOTSTRAP_FAILED,
                )
            if isinstance(reply, RankTable):
                last = reply
                if reply.complete or not until_complete:
                    return reply
            request = TableRequest(agent_id=agent_id)
        await asyncio.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            break
    raise _incomplete(address, timeout_s, last)


async def _authenticate(
    socket: zmq.asyncio.Socket, security: Security, address: str, deadline: float, timeout_s: float
) -> None:
    try:
        await authenticate(socket, security, f"bootstrap {address}", max(0.0, deadline - time.monotonic()))
    except AuthError:
        socket.close(linger=REFUSAL_LINGER_MS)  # let our refusal, if any, reach the listener
        raise
    except PdTransferError:  # no answer (yet): the same error as an unanswered request
        raise _incomplete(address, timeout_s, RankTable(expected=0)) from None


def _incomplete(address: str, timeout_s: float, last: RankTable) -> PdTransferError:
    if last.expected:
        detail = f"{len(last.entries)} of {last.expected} prefill ranks registered"
    else:
        detail = "no answer" if not last.entries else "the table is empty"
    return PdTransferError(
        f"bootstrap {address}: rank table incomplete after {timeout_s:.1f} s ({detail})",
        code=Reason.BOOTSTRAP_FAILED,
        hint="check that every prefill rank's sidecar and worker are running",
    )
