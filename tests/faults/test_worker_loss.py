"""A sidecar lets go of a worker that died: its registration lives as long as its connection.

The worker is a real child process using the client library (the blocking
``Client`` or the ``AsyncClient``, over ``unix://`` or ``ipc://``). It
registers pools this test allocated (so their bytes are known), starts a room
and is SIGKILLed. Its sidecar then fails the live room with ``worker_lost``,
unmaps the pools (its ``/proc/PID/maps`` lists no segment of them, and its
``RssShmem`` drops by their size), answers ``/readyz`` 503 with the reason,
and takes the registration of a restarted worker, after which a room moves
byte-exact with a new verdict.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import pytest
from fault_tools import kill, kv_requests, tiny_ranks, wait_for, wait_status

from pd_transfer.client import RoomStatus, allocate_pools
from pd_transfer.layout.geometry import Role

NUM_PAGES = 2048  # 2 layers x K,V x 2048 pages x 256 B = 2 MiB of KV per rank

_WORKER = r"""
import asyncio, json, pickle, sys
from pd_transfer.client import AsyncClient, Client
endpoint, geometry_path, kind, actions = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
geometry, handles = pickle.load(open(geometry_path, "rb"))

def step(call, action):
    op, *args = action
    if op == "register":
        return call.register(geometry, handles, timeout_s=20)
    if op == "send":
        room, pages, last = args
        return call.send(room, pages, last_chunk=last)
    if op == "expect":
        room, bootstrap, pages = args
        return call.expect(room, bootstrap, pages)

if kind == "sync":
    client = Client(endpoint, "child", timeout_s=20)
    for action in actions:
        step(client, action)
else:
    async def main():
        client = AsyncClient(endpoint, "child", timeout_s=20)
        for action in actions:
            await step(client, action)
        return client
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(main())
print("ready", flush=True)
sys.stdin.read()   # until killed
"""


def _worker(cluster, geometry, pools, kind: str, actions: list) -> subprocess.Popen:
    path = cluster.workdir / f"geometry-{geometry.role.value}-{time.monotonic_ns()}.pickle"
    path.write_bytes(pickle.dumps((geometry, dict(pools.handles))))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _WORKER,
            cluster.sidecars[geometry.rank_id].endpoint,
            str(path),
            kind,
            json.dumps(actions),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    if line != "ready":
        child.kill()
        child.wait()
        raise RuntimeError(f"worker child: {line!r}")
    return child


def _mapped_segments(pid: int, pools) -> list[str]:
    names = [handle for handle in pools.handles.values()]
    with open(f"/proc/{pid}/maps") as maps:
        return [line.strip() for line in maps if any(name in line for name in names)]


def _shmem_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def _pair(deployment, scheme: str, child: Role):
    """A TP 1 pair; the worker of ``child`` is a child process (pools allocated here, filled
    with the oracle's bytes), the other one is this test."""
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=NUM_PAGES),
        tiny_ranks(Role.DECODE, 1, num_pages=NUM_PAGES),
        attach=False,
        worker_scheme=scheme,
    )
    pools = {}
    for geometry in cluster.prefill + cluster.decode:
        if geometry.role is not child:
            cluster._attach(geometry, cluster._tag)
            continue
        pools[geometry.rank_id] = cluster.pools[geometry.rank_id] = allocate_pools(
            geometry, f"t{cluster._tag}-child"
        )
        world = (cluster.world.prefill_buffers if child is Role.PREFILL else cluster.world.decode_buffers)[
            geometry.rank_id
        ]
        for region_id, array in pools[geometry.rank_id].arrays.items():
            array[:] = world[region_id]
    return cluster, pools


@pytest.mark.parametrize("scheme,kind", [("unix", "sync"), ("ipc", "async")])
def test_a_killed_prefill_worker_is_let_go_and_its_restart_moves_a_room(deployment, scheme, kind):
    cluster, pools = _pair(deployment, scheme, Role.PREFILL)
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    pid = cluster.sidecars[prefill.rank_id].proc.pid
    before_kib = _shmem_kib(pid)
    decode_client = cluster.clients[decode.rank_id]
    decode_client.expect(1, cluster.bootstrap, list(range(16, 32)))
    child = _worker(
        cluster, prefill, pools[prefill.rank_id], kind, [["register"], ["send", 1, list(range(0, 8)), False]]
    )
    try:
        wait_status(decode_client, 1, [RoomStatus.TRANSFERRING])
        assert cluster.http(prefill.rank_id, "/readyz")[0] == 200
        assert _mapped_segments(pid, pools[prefill.rank_id])
        pools_kib = sum(r.nbytes for r in prefill.regions) // 1024
        mapped_kib = _shmem_kib(pid)
        assert mapped_kib - before_kib >= pools_kib, f"{mapped_kib - before_kib} KiB mapped"
        verdicts = cluster.metric(prefill.rank_id, "pd_transfer_verdicts_total", outcome="accepted")
    finally:
        kill(child)

    # the room fails at once with the reason, not at its timeout
    state = decode_client.wait(1, timeout_s=10)
    assert state.status is RoomStatus.FAILED and state.code_text == "worker_lost", state.reason
    assert "the prefill worker is gone" in state.reason and "connection" in state.reason
    status, body = wait_for(
        lambda: (r := cluster.http(prefill.rank_id, "/readyz"))[0] == 503 and r, 60, "prefill /readyz 503"
    )
    assert "worker child is gone" in body and "register again" in body, body
    wait_for(
        lambda: not _mapped_segments(pid, pools[prefill.rank_id]),
        60,
        "the prefill sidecar unmapping the pools",
    )
    # its RssShmem drops by the pools' size (it keeps the decode peer's pools mapped)
    assert mapped_kib - _shmem_kib(pid) >= 0.9 * pools_kib, (mapped_kib, _shmem_kib(pid), pools_kib)

    # the restarted worker registers (no already_registered) and a room moves byte-exact
    requests = kv_requests(range(40, 56), range(100, 116))
    child = _worker(cluster, prefill, pools[prefill.rank_id], kind, [["register"]])
    try:
        assert wait_for(
            lambda: cluster.http(prefill.rank_id, "/readyz")[0] == 200, 60, "prefill /readyz 200 again"
        )
        cluster.expect(2, requests)
        wait_status(decode_client, 2, [RoomStatus.WAITING_FOR_INPUT])  # prefill has room 2
        kill(child)  # the room below is sent by a second restart, after this one died idle
        wait_for(lambda: not _mapped_segments(pid, pools[prefill.rank_id]), 60, "released again")
        child = _worker(
            cluster,
            prefill,
            pools[prefill.rank_id],
            kind,
            [["register"], ["send", 3, [int(p) for p in requests[list(requests)[0]][0]], True]],
        )
        cluster.expect(3, requests)
        state = decode_client.wait(3, timeout_s=15)
        assert state.status is RoomStatus.SUCCESS, state.reason
        # room 3 byte-exact; of room 1 exactly its first chunk landed, nothing else anywhere
        assert (
            cluster.verify(
                kv_requests(
                    list(range(0, 8)) + list(range(40, 56)), list(range(16, 24)) + list(range(100, 116))
                )
            )
            == []
        )
        assert decode_client.wait(2, timeout_s=10).code_text == "worker_lost"
        # the decode peer was given a new verdict for each registration
        assert cluster.metric(prefill.rank_id, "pd_transfer_verdicts_total", outcome="accepted") > verdicts
    finally:
        kill(child)


@pytest.mark.parametrize("scheme,kind", [("ipc", "sync"), ("unix", "async")])
def test_a_killed_decode_worker_is_let_go_on_both_sides_and_its_restart_moves_a_room(
    deployment, scheme, kind
):
    cluster, pools = _pair(deployment, scheme, Role.DECODE)
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    decode_pid = cluster.sidecars[decode.rank_id].proc.pid
    prefill_pid = cluster.sidecars[prefill.rank_id].proc.pid
    child = _worker(
        cluster,
        decode,
        pools[decode.rank_id],
        kind,
        [["register"], ["expect", 1, cluster.bootstrap, list(range(16, 32))]],
    )
    try:
        wait_status(cluster.clients[prefill.rank_id], 1, [RoomStatus.WAITING_FOR_INPUT])
        assert _mapped_segments(decode_pid, pools[decode.rank_id])
        assert _mapped_segments(prefill_pid, pools[decode.rank_id])  # shm: prefill writes in place
    finally:
        kill(child)

    state = wait_status(cluster.clients[prefill.rank_id], 1, [RoomStatus.FAILED])
    assert state.code_text == "aborted" and "the decode worker is gone" in state.reason, state.reason
    status, body = wait_for(
        lambda: (r := cluster.http(decode.rank_id, "/readyz"))[0] == 503 and r, 60, "decode /readyz 503"
    )
    assert "worker child is gone" in body, body
    peers = json.loads(cluster.http(decode.rank_id, "/status")[1])["peers"]
    assert [(p["state"], "the decode worker is gone" in p["reason"]) for p in peers] == [("left", True)], (
        peers
    )
    # both sidecars let go of the decode pools: decode its own mapping, prefill its link's
    wait_for(lambda: not _mapped_segments(decode_pid, pools[decode.rank_id]), 60, "decode unmapped")
    wait_for(
        lambda: not _mapped_segments(prefill_pid, pools[decode.rank_id]),
        60,
        "prefill unmapped the decode pools",
    )

    requests = kv_requests(range(40, 56), range(100, 116))
    src, dst = (list(map(int, idx)) for idx in requests[list(requests)[0]])
    child = _worker(
        cluster, decode, pools[decode.rank_id], kind, [["register"], ["expect", 2, cluster.bootstrap, dst]]
    )
    try:
        cluster.clients[prefill.rank_id].send(2, src)
        state = wait_status(
            cluster.clients[prefill.rank_id], 2, [RoomStatus.SUCCESS, RoomStatus.FAILED], timeout_s=15
        )
        assert state.status is RoomStatus.SUCCESS, state.reason
        wait_for(lambda: cluster.http(decode.rank_id, "/readyz")[0] == 200, 60, "decode ready")
    finally:
        kill(child)
    assert cluster.verify(requests) == []
