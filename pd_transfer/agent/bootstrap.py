"""The rank table: prefill rank 0 serves it, everyone else asks.

Every prefill rank's sidecar announces itself (geometry, control address,
host) to rank 0's bootstrap socket. Decode sidecars, and the prefill ranks
themselves, ask for the table and get it back, with how many ranks are
expected; callers retry until it is complete or their deadline passes.
An announcement from a rank already listed replaces it (a restarted sidecar
comes back with a new address), so nobody keeps a stale endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pd_transfer.errors import PdTransferError, ProtocolError, Reason
from pd_transfer.protocol import Announce, RankEntry, RankTable, TableRequest, decode, encode

log = logging.getLogger(__name__)


class BootstrapServer:
    """Rank 0's table of prefill ranks, served on its own ROUTER."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.entries: dict[tuple[int, int], RankEntry] = {}
        self.expected = 0
        self.bad_frames = 0

    def add(self, entry: RankEntry) -> None:
        key = (entry.geometry.pp_rank, entry.geometry.tp_rank)
        self.entries[key] = entry
        self.expected = entry.geometry.tp_size * entry.pp_size

    def table(self) -> RankTable:
        entries = tuple(self.entries[k] for k in sorted(self.entries))
        return RankTable(expected=self.expected, entries=entries)

    async def serve(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:
                self.bad_frames += 1
                continue
            identity, frame = frames
            try:
                message = decode(frame)
            except ProtocolError as err:
                self.bad_frames += 1
                log.warning("bootstrap: bad frame: %s", err)
                continue
            if isinstance(message, Announce):
                self.add(message.entry)
                log.info("bootstrap: %s announced at %s (%d/%d ranks)",
                         message.entry.geometry.rank_id, message.entry.control_address,
                         len(self.entries), self.expected)
            elif not isinstance(message, TableRequest):
                self.bad_frames += 1
                continue
            await self.socket.send_multipart([identity, encode(self.table())])

    def close(self) -> None:
        self.socket.close(linger=0)


async def fetch_table(context: zmq.asyncio.Context, address: str, agent_id: str,
                      timeout_s: float, announce: RankEntry | None = None,
                      poll_interval_s: float = 0.05) -> RankTable:
    """Ask ``address`` for the rank table until it is complete or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    last = RankTable(expected=0)
    try:
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
                    raise PdTransferError(f"bootstrap {address} sent a bad frame: {err}",
                                          code=Reason.BOOTSTRAP_FAILED) from None
                if isinstance(reply, RankTable):
                    last = reply
                    if reply.complete:
                        return reply
                request = TableRequest(agent_id=agent_id)
            await asyncio.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
    finally:
        socket.close(linger=0)
    if last.expected:
        detail = f"{len(last.entries)} of {last.expected} prefill ranks registered"
    else:
        detail = "no answer" if not last.entries else "the table is empty"
    raise PdTransferError(f"bootstrap {address}: rank table incomplete after {timeout_s:.1f} s "
                          f"({detail})", code=Reason.BOOTSTRAP_FAILED,
                          hint="check that every prefill rank's sidecar and worker are running")
