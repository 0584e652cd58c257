"""Same-host rooms end through the decode sidecar's doorbells, and both sides agree.

The decode sidecar is stopped (SIGSTOP) once the room's requests went out:
the decode worker's ``wait`` can then only learn of the room's end from the
doorbell the prefill sidecar rings, never from its own sidecar.
"""

import asyncio
import signal
import time

import numpy as np
import pytest
from cluster import poll_known, random_requests, small_instances

from pd_transfer.client import AsyncClient, RoomStatus
from pd_transfer.errors import Reason
from pd_transfer.layout.views import Pool
from pd_transfer.memory import doorbell

pytestmark = pytest.mark.skipif(not doorbell.AVAILABLE, reason="doorbells need Linux on x86-64")


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _requests_reached_prefill(cluster, room: int) -> None:
    """Every prefill rank holds every decode rank's request for ``room`` (it waits for
    input). Decode's status moves on once its requests are queued on its sockets, not
    once they left: stopping decode earlier can hold one in its ZeroMQ I/O thread."""
    for g in cluster.prefill:
        client = cluster.clients[g.rank_id]
        _until(lambda c=client: getattr(poll_known(c, room), "status", None) is RoomStatus.WAITING_FOR_INPUT)


@pytest.mark.parametrize(
    "model,tp_src,tp_dst,call",
    [("llama-3.1-8b", 1, 1, "wait"), ("llama-3.1-8b", 4, 2, "wait"), ("llama-3.1-8b", 4, 2, "poll")],
)
def test_the_worker_learns_of_landed_bytes_while_its_sidecar_is_stopped(
    cluster_factory, model, tp_src, tp_dst, call
):
    prefill, decode = small_instances(model, tp_src, tp_dst)  # 4 -> 2: two writers a room
    cluster = cluster_factory(prefill, decode)
    requests = random_requests(prefill, decode, np.random.default_rng(5), pages=3)
    cluster.expect(21, requests)
    for g in decode:
        client = cluster.clients[g.rank_id]
        _until(lambda c=client: c.poll(21).status is RoomStatus.WAITING_FOR_INPUT)
    _requests_reached_prefill(cluster, 21)
    stopped = [cluster.sidecars[g.rank_id].proc for g in decode]
    for proc in stopped:
        proc.send_signal(signal.SIGSTOP)
    try:
        cluster.send(21, requests)
        if call == "wait":
            states = cluster.wait_decode(21, timeout_s=15)
        else:  # prefill rang (its Success waits for decode's confirmation, which the
            # stopped sidecar cannot send): a poll answers from the doorbell, where asking
            # the stopped sidecar would time out
            for g in prefill:
                _until(lambda r=g.rank_id: _count(cluster, r, "prefill", "rang") == 1)
            states = {g.rank_id: cluster.clients[g.rank_id].poll(21) for g in decode}
    finally:
        for proc in stopped:
            proc.send_signal(signal.SIGCONT)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []
    for g in decode:  # its sidecar, running again, tells the same, and counts the ring
        assert cluster.clients[g.rank_id].poll(21).status is RoomStatus.SUCCESS
        assert _count(cluster, g.rank_id, "decode", "rung") == 1
    for g in prefill:  # 1 -> 1 and 4 -> 2: every prefill rank writes one decode rank
        assert _count(cluster, g.rank_id, "prefill", "rang") == 1


def _count(cluster, rank_id: str, role: str, event: str) -> float:
    status, text = cluster.http(rank_id, "/metrics")
    assert status == 200
    line = f'pd_transfer_doorbells_total{{event="{event}",role="{role}"}} '
    values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    return values[0] if values else 0.0


def test_a_room_without_doorbells_ends_through_messages(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 2, 4)
    cluster = cluster_factory(prefill, decode, decode_config={"doorbell": False})
    requests = random_requests(prefill, decode, np.random.default_rng(6), pages=3)
    cluster.expect(22, requests)
    cluster.send(22, requests)
    states = cluster.wait_decode(22)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), (states, cluster.logs())
    assert cluster.verify(requests) == []


def test_a_failed_room_wakes_the_waiting_worker_with_its_reason(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 1, 1)
    cluster = cluster_factory(prefill, decode, config={"waiting_timeout_s": 1.0})
    requests = random_requests(prefill, decode, np.random.default_rng(7), pages=2)
    cluster.expect(23, requests)  # prefill never sends: the room times out waiting for input
    started = time.monotonic()
    state = cluster.clients[decode[0].rank_id].wait(23, 30)
    assert state.status is RoomStatus.FAILED and state.code is Reason.TIMEOUT, state
    assert time.monotonic() - started < 10
    assert _count(cluster, decode[0].rank_id, "decode", "closed") == 1


def test_an_asyncio_worker_learns_of_landed_bytes_while_its_sidecar_is_stopped(cluster_factory):
    prefill, decode = small_instances("llama-3.1-8b", 4, 2)
    cluster = cluster_factory(prefill, decode)
    requests = random_requests(prefill, decode, np.random.default_rng(8), pages=3)
    dst = {pool: idx for pool, (_, idx) in requests.items()}
    procs = [cluster.sidecars[g.rank_id].proc for g in decode]

    async def run() -> list:
        clients = [AsyncClient(cluster.sidecars[g.rank_id].endpoint, g.rank_id, timeout_s=20) for g in decode]
        try:
            for client in clients:
                await client.expect(24, cluster.bootstrap, dst[Pool.KV], aux_row=int(dst[Pool.AUX][0]))
            for client in clients:
                while (await client.poll(24)).status is not RoomStatus.WAITING_FOR_INPUT:
                    await asyncio.sleep(0.02)
            await asyncio.to_thread(_requests_reached_prefill, cluster, 24)
            for proc in procs:
                proc.send_signal(signal.SIGSTOP)
            # many waits at once, one of them cancelled on the way: one watcher thread serves them
            waits = [asyncio.create_task(c.wait(24, 15)) for c in clients for _ in range(3)]
            doomed = asyncio.create_task(clients[0].wait(24, 15))
            await asyncio.sleep(0.1)
            doomed.cancel()
            cluster.send(24, requests)
            return await asyncio.gather(*waits)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
            for client in clients:
                client.close()

    states = asyncio.run(run())
    assert all(s.status is RoomStatus.SUCCESS for s in states), (states, cluster.logs())
    assert cluster.verify(requests) == []
