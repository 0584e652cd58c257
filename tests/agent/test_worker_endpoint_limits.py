"""The worker endpoint keeps at most max_worker_requests in progress; one more is refused at once."""

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from pd_transfer.agent.auth import SecureContext, Security
from pd_transfer.agent.worker_endpoint import WorkerEndpoint
from pd_transfer.protocol import worker_api

pytestmark = pytest.mark.asyncio


async def test_a_request_over_max_worker_requests_is_refused_with_over_limit_and_the_rest_served(tmp_path):
    context = SecureContext(Security())
    release = asyncio.Event()
    refused = []

    async def handler(request, connection):
        await release.wait()  # e.g. a worker's wait() that has not returned yet
        return {"status": "success"}

    endpoint = WorkerEndpoint(
        context, f"ipc://{tmp_path}/w.sock", handler, max_requests=2, on_over_limit=lambda: refused.append(1)
    )
    server = asyncio.create_task(endpoint.serve())
    worker = context.socket(zmq.DEALER)
    worker.connect(endpoint.address)
    try:
        for request_id in (1, 2, 3):
            await worker.send(worker_api.encode({"op": "poll", "id": request_id, "room": 7}))
        reply = msgpack.unpackb(await asyncio.wait_for(worker.recv(), 10), raw=False)
        assert reply["id"] == 3 and reply["ok"] is False and reply["code"] == "over_limit"
        assert "2 worker requests are in progress, the limit is max_worker_requests=2" in reply["reason"]
        assert refused == [1]
        release.set()  # the two in progress finish normally
        replies = [msgpack.unpackb(await asyncio.wait_for(worker.recv(), 10), raw=False) for _ in range(2)]
        assert sorted(r["id"] for r in replies) == [1, 2] and all(r["ok"] for r in replies)
    finally:
        worker.close(linger=0)
        server.cancel()
        endpoint.close()
        context.destroy(linger=0)


async def test_a_malformed_request_is_answered_with_its_own_id_and_the_endpoint_keeps_serving(tmp_path):
    context = SecureContext(Security())
    bad = []

    async def handler(request, connection):
        if request.room == 8:  # a refusal of the handler's own, after the id was read
            raise worker_api.WorkerApiError("at $.room: not expected here")
        return {"status": "success"}

    endpoint = WorkerEndpoint(context, f"ipc://{tmp_path}/w.sock", handler, on_bad_request=bad.append)
    server = asyncio.create_task(endpoint.serve())
    worker = context.socket(zmq.DEALER)
    worker.connect(endpoint.address)
    try:
        replies = []
        for message in ({"op": "poll", "id": 5, "room": "x"}, {"op": "poll", "id": 6, "room": 8}):
            await worker.send(worker_api.encode(message))
            replies.append(msgpack.unpackb(await asyncio.wait_for(worker.recv(), 10), raw=False))
        assert [(r["id"], r["ok"]) for r in replies] == [(5, False), (6, False)]
        assert "at $.room" in replies[0]["reason"] and "not expected here" in replies[1]["reason"]
        await worker.send(worker_api.encode({"op": "poll", "id": 7, "room": 7}))
        served = msgpack.unpackb(await asyncio.wait_for(worker.recv(), 10), raw=False)
        assert served["id"] == 7 and served["ok"] is True
        assert len(bad) == 2
    finally:
        worker.close(linger=0)
        server.cancel()
        endpoint.close()
        context.destroy(linger=0)
