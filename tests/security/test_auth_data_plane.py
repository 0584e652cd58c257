"""The tcp data plane's plain sockets run the shared-secret handshake before any chunk lands."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from secure_cluster import SECRET_HEX, metric, ranks, requests, security, start, write_secret

from pd_transfer.agent.tcp_plane import DataAuth
from pd_transfer.client import RoomStatus
from pd_transfer.errors import Reason, TransportError
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.lowering import RunBatch, TransferPlan
from pd_transfer.transport import PeerEndpoint, TcpReceiver, TcpTransport

SECRET = "ab" * 32
OTHER = "cd" * 32
NBYTES = 1 << 16


def _plan() -> TransferPlan:
    zero = np.array([0], np.int64)
    return TransferPlan(
        "p0", "d0", (RunBatch("s", "kv", zero, zero, np.array([NBYTES]), np.array([1]), 0, 0),)
    )


def _counting(secret_hex: str | None, agent_id: str):
    sec = security(secret_hex, agent_id)
    failures = []
    sec.on_failure = failures.append
    return sec, failures


async def _write(sender_secret, receiver_secret):
    """One write between a transport and a receiver with these secrets (None: auth off)."""
    region = np.zeros(NBYTES, np.uint8)
    send_sec, send_failures = _counting(sender_secret, "prefill-0")
    recv_sec, recv_failures = _counting(receiver_secret, "decode-0")
    receiver = TcpReceiver(
        "127.0.0.1",
        {"kv": region},
        handshake_timeout_s=3,
        auth=DataAuth(recv_sec) if receiver_secret else None,
    )
    transport = TcpTransport(auth=DataAuth(send_sec) if sender_secret else None, handshake_timeout_s=3)
    async with receiver:
        link = await transport.connect(PeerEndpoint("d0", data_address=receiver.address))
        try:
            result = await asyncio.wait_for(
                transport.write(link, _plan(), {"s": np.full(NBYTES, 7, np.uint8)}), 10
            )
        except TransportError as err:
            result = err
        finally:
            await transport.close()
    return result, region, receiver.stats, send_failures, recv_failures


@pytest.mark.asyncio
async def test_same_secret_lands():
    result, region, stats, send_failures, recv_failures = await _write(SECRET, SECRET)
    assert result == NBYTES and (region == 7).all()
    assert stats.frames_refused == 0 and send_failures == recv_failures == []


@pytest.mark.asyncio
async def test_wrong_secret_is_refused_counted_and_writes_nothing():
    result, region, stats, send_failures, recv_failures = await _write(OTHER, SECRET)
    assert isinstance(result, TransportError) and result.code is Reason.AUTH_FAILED
    assert "different secrets" in result.message
    assert not region.any()
    assert send_failures == ["auth_failed"] and stats.refused[Reason.AUTH_FAILED] >= 1
    assert recv_failures == ["auth_failed"]


@pytest.mark.asyncio
async def test_a_sender_without_the_secret_is_refused_as_unauthenticated():
    result, region, stats, _, recv_failures = await _write(None, SECRET)
    assert isinstance(result, TransportError) and result.code is Reason.UNAUTHENTICATED
    assert not region.any()
    assert stats.refused[Reason.UNAUTHENTICATED] == 1 and recv_failures == ["unauthenticated"]


@pytest.mark.asyncio
async def test_a_receiver_without_authentication_is_not_trusted_by_a_sender_with_it():
    result, region, stats, send_failures, _ = await _write(SECRET, None)
    assert isinstance(result, TransportError) and result.code is Reason.AUTH_FAILED
    assert "authentication on at both ends" in result.message
    assert not region.any() and send_failures == ["auth_failed"]


def test_sidecars_with_the_secret_move_a_room_over_tcp_byte_exact(workdir):
    secret = write_secret(workdir, "secret-tcp", SECRET_HEX)
    cluster = start(
        workdir, ranks(Role.PREFILL, 1), ranks(Role.DECODE, 1), secret, config={"transport": "tcp"}
    )
    try:
        cluster.expect(1, requests(1))
        cluster.send(1, requests(1))
        states = cluster.wait_decode(1, timeout_s=15)
        assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
        assert cluster.verify(requests(1)) == []
        for rank in cluster.sidecars:
            assert metric(cluster, rank, "pd_transfer_auth_failures_total") == 0
    finally:
        cluster.close()
