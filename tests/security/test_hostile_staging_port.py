"""Strangers on the engines' staging port: the same gate as the tcp data port.

A decode rank on an engine transport (mooncake, nixl) serves a staging
control channel (:class:`~pd_transfer.transport.engines.staging.receiver.StagingReceiver`)
on a plain socket. With a secret, a stranger there may declare at most 4 KiB of
header before it authenticates, has one deadline for the whole handshake, and
waits among at most ``max_pending`` others, so that a flood of them does not
keep a real prefill out. Each refusal is counted and reported as a bad frame.
The receiver runs with the sidecar's real HMAC handshake (:class:`DataAuth`)
on real loopback sockets.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter

import numpy as np
import pytest
from hostile_wire import MiB, connection_dropped, host_port, wait_for
from secure_cluster import SECRET_HEX, security

from pd_transfer.agent.tcp_plane import DataAuth
from pd_transfer.errors import Reason
from pd_transfer.transport.engines.staging.receiver import StagingArea, StagingReceiver
from pd_transfer.transport.engines.staging.sender import open_channel
from pd_transfer.transport.tcp.sockets import Kind, prefix

pytestmark = pytest.mark.asyncio
DEADLINE_S = 1.5
MAX_PENDING = 8
SLOT = 64 << 10


class Port:
    """A StagingReceiver with a secret, and what it reported as bad frames."""

    def __init__(self) -> None:
        self.bad = Counter()
        self.area = StagingArea(8, SLOT)
        self.receiver = StagingReceiver(
            {"kv": np.zeros(1 << 16, np.uint8)},
            self.area,
            auth=DataAuth(security(SECRET_HEX, "decode-0")),
            handshake_timeout_s=DEADLINE_S,
            max_pending=MAX_PENDING,
            on_bad_frame=lambda reason: self.bad.update([reason]),
        )

    async def __aenter__(self) -> Port:
        await self.receiver.start()
        self.address = host_port(self.receiver.address)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.receiver.stop()

    async def real_prefill_gets_a_ring(self) -> None:
        auth = DataAuth(security(SECRET_HEX, "prefill-0"))
        channel = await asyncio.to_thread(
            open_channel,
            self.receiver.address,
            self.area.published,
            "decode-0",
            ring_slots=2,
            auth=auth,
            timeout_s=10,
        )
        try:
            assert channel is not None and len(channel.slots) == 2
        finally:
            channel.close()


def _connect(address) -> socket.socket:
    return socket.create_connection(address, timeout=5)


@pytest.mark.parametrize(
    "kind,reason", [(Kind.HANDSHAKE, Reason.FRAME_TOO_LARGE), (Kind.DATA, Reason.FRAME_TOO_LARGE)]
)
async def test_a_first_frame_declaring_8_mib_of_header_is_dropped_by_its_prefix(kind, reason):
    async with Port() as port:

        def attack() -> tuple[int, bool]:
            sock = _connect(port.address)
            try:
                sock.sendall(prefix(kind, 8 * MiB))
                sent, piece = 0, b"\x00" * MiB
                try:
                    while sent < 8 * MiB:
                        sent += sock.send(piece)
                except OSError:
                    pass
                return sent, connection_dropped(sock)
            finally:
                sock.close()

        sent, dropped = await asyncio.to_thread(attack)
        assert dropped, "the receiver kept a stranger that declared 8 MiB of header"
        await asyncio.to_thread(
            wait_for, lambda: port.bad[reason.value] == 1, 5, f"the refusal reported as {reason.value}"
        )
        await port.real_prefill_gets_a_ring()


async def test_a_handshake_trickling_in_is_cut_off_at_its_deadline():
    """One byte every 0.3 s never leaves the socket idle long, but the deadline is 1.5 s."""
    async with Port() as port:

        def trickle() -> float | None:
            sock = _connect(port.address)
            started = time.monotonic()
            try:
                for byte in prefix(Kind.HANDSHAKE, 100) + b"\x00" * 100:
                    try:
                        sock.sendall(bytes([byte]))
                    except OSError:
                        return time.monotonic() - started
                    if connection_dropped(sock, timeout_s=0.3):
                        return time.monotonic() - started
                    if time.monotonic() - started > 4 * DEADLINE_S:
                        return None
            finally:
                sock.close()
            return None

        dropped_s = await asyncio.to_thread(trickle)
        assert dropped_s is not None, f"still connected after {4 * DEADLINE_S} s"
        assert dropped_s >= DEADLINE_S * 0.9, f"dropped after {dropped_s:.2f} s"
        await asyncio.to_thread(
            wait_for, lambda: port.bad[Reason.TIMEOUT.value] == 1, 5, "the cut-off handshake reported"
        )
        await port.real_prefill_gets_a_ring()


async def test_a_flood_of_strangers_does_not_keep_a_real_prefill_out():
    """Four times ``max_pending`` idle strangers: the oldest make room, the prefill gets in."""
    async with Port() as port:
        socks = [await asyncio.to_thread(_connect, port.address) for _ in range(4 * MAX_PENDING)]
        try:
            await asyncio.sleep(0.2)
            await port.real_prefill_gets_a_ring()
            await asyncio.to_thread(
                wait_for,
                lambda: port.bad[Reason.LIMIT_EXCEEDED.value] >= 3 * MAX_PENDING,
                5,
                "the oldest strangers cut off to make room",
            )
            pending = [c for c in port.receiver._connections if c.authenticated is None]
            assert len(pending) <= MAX_PENDING
        finally:
            for sock in socks:
                sock.close()


async def test_a_request_before_the_handshake_is_refused_and_reported():
    async with Port() as port:

        def early() -> bool:
            sock = _connect(port.address)
            try:
                sock.sendall(prefix(Kind.DATA, 16) + b"\x00" * 16)
                return connection_dropped(sock)
            finally:
                sock.close()

        assert await asyncio.to_thread(early)
        await asyncio.to_thread(
            wait_for, lambda: port.bad[Reason.UNAUTHENTICATED.value] == 1, 5, "the early request reported"
        )
        await port.real_prefill_gets_a_ring()
