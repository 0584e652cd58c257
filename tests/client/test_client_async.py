"""The asyncio client: concurrent calls, each matched to its own reply."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_transfer.client import AsyncClient, ClientClosed, Refused, ReplyTimeout, RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.protocol.worker_api import WorkerOp


@pytest.mark.asyncio
async def test_concurrent_waits_each_get_their_own_rooms_reply(sidecar):
    def script(op, message):
        if op is WorkerOp.WAIT:
            room = message["room"]
            if room == 1:
                return {"ok": True, "status": "failed", "code": "timeout", "reason": "room 1 timed out"}
            return {"ok": True, "status": "success"}
        return {"ok": True}

    sidecar.script = script
    sidecar.delays[WorkerOp.WAIT] = 0.2
    async with AsyncClient(sidecar.endpoint, "decode-tp0", timeout_s=2.0) as client:
        first, second, _ = await asyncio.gather(
            client.wait(1, 5.0), client.wait(2, 5.0), client.expect(3, "tcp://127.0.0.1:9", [0, 1])
        )
    assert (first.status, first.code, first.reason) == (RoomStatus.FAILED, Reason.TIMEOUT, "room 1 timed out")
    assert second.succeeded
    assert sorted(op.value for op in sidecar.ops()) == ["expect", "wait", "wait"]


@pytest.mark.asyncio
async def test_async_calls_encode_like_the_blocking_client(sidecar):
    async with AsyncClient(sidecar.endpoint, "prefill-tp0") as client:
        await client.send(4, [3, 1], state_slots=[0], aux_row=2, last_chunk=True, swa_pages=[5])
        await client.layer_ready(4, 2)
        assert (await client.poll(4)).succeeded
        assert await client.abort(4) is True
    send = sidecar.requests[0][1]
    assert (send["pages"], send["state_slots"], send["aux_row"], send["swa_pages"], send["last"]) == (
        [3, 1],
        [0],
        2,
        [5],
        True,
    )
    assert sidecar.ops() == [WorkerOp.SEND, WorkerOp.LAYER_READY, WorkerOp.POLL, WorkerOp.ABORT]


@pytest.mark.asyncio
async def test_async_refusal_raises_with_code_and_reason(sidecar):
    sidecar.script = lambda op, m: {"ok": False, "code": "not_registered", "reason": "register before expect"}
    async with AsyncClient(sidecar.endpoint, "w") as client:
        with pytest.raises(Refused) as caught:
            await client.expect(1, "tcp://127.0.0.1:9", [0])
    assert (caught.value.code, caught.value.reason) == (Reason.NOT_REGISTERED, "register before expect")


@pytest.mark.asyncio
async def test_async_timeout_sleeps_instead_of_spinning(sidecar):
    sidecar.script = lambda op, m: None
    async with AsyncClient(sidecar.endpoint, "w", timeout_s=0.4) as client:
        cpu_before, wall_before = time.thread_time(), time.monotonic()
        with pytest.raises(ReplyTimeout, match="poll: no reply"):
            await client.poll(1)
        cpu_s, wall_s = time.thread_time() - cpu_before, time.monotonic() - wall_before
    assert wall_s >= 0.4
    assert cpu_s < 0.05, f"the loop burnt {cpu_s:.3f} s of CPU waiting {wall_s:.3f} s"


@pytest.mark.asyncio
async def test_a_late_reply_does_not_answer_a_later_call(sidecar):
    sidecar.delays[WorkerOp.POLL] = 0.4
    async with AsyncClient(sidecar.endpoint, "w", timeout_s=0.2) as client:
        with pytest.raises(ReplyTimeout):
            await client.poll(1)
        sidecar.script = lambda op, m: {"ok": True, "drained": False}
        await asyncio.sleep(0.3)
        assert await client.abort(1) is False


@pytest.mark.asyncio
async def test_closing_fails_the_calls_in_flight(sidecar):
    sidecar.script = lambda op, m: None
    client = AsyncClient(sidecar.endpoint, "w", timeout_s=5.0)
    call = asyncio.ensure_future(client.wait(1, 5.0))
    await asyncio.sleep(0.1)
    client.close()
    with pytest.raises(ClientClosed, match="wait: the client is closed"):
        await call
    with pytest.raises(ClientClosed):
        await client.poll(1)
