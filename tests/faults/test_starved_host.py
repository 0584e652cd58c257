"""On a host whose CPUs are all busy, no room fails that should succeed; faults still show.

A sidecar lives next to an engine whose scheduler and tokenizer threads keep
the CPUs busy. Here two busy processes per CPU this process may use compete
with the sidecars for the whole module (started and killed by the
``starved`` fixture). Under that load:

- the README's demo (default arguments; and over tcp, with 8 requests to keep
  the module short) verifies every byte and fails no room: its decode ranks finish and leave at different times, and
  their sidecars and workers are all starved;
- sidecars with the tests' short heartbeats (0.2 s, 5 misses) move rooms
  across many heartbeat limits and declare no peer lost;
- a decode sidecar killed with SIGKILL still fails the prefill's room in
  flight within the bound of test_killed_sidecars.py, and one stopped with
  SIGSTOP is still declared lost, as stopped.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from fault_tools import check_sim, fill_sim, kv_requests, tiny_ranks, wait_status

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

SEED = 29
LOST_WITHIN_S = 5 * 0.2 * 3  # test_killed_sidecars.py's bound: a few heartbeat limits


@pytest.fixture(scope="module")
def starved():
    """Two busy processes per CPU, for the module's tests."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    yield
    for burner in burners:
        burner.kill()
        burner.wait()


@pytest.mark.parametrize("args", [[], ["--transport", "tcp", "--requests", "8"]], ids=["shm", "tcp"])
def test_the_readme_demo_fails_no_room_on_a_starved_host(starved, args):
    result = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "result: OK" in result.stdout


def _pair(deployment, decode_tp: int = 1):
    cluster = deployment(
        tiny_ranks(Role.PREFILL, 1, num_pages=32), tiny_ranks(Role.DECODE, decode_tp, num_pages=32)
    )
    fill_sim(cluster, SEED)
    return cluster


def test_starved_sidecars_lose_no_peer_across_heartbeat_limits(starved, deployment):
    cluster = _pair(deployment, decode_tp=2)
    for room in range(1, 9):
        requests = kv_requests(range(room, room + 2), range(2 * room, 2 * room + 2))
        cluster.expect(room, requests)
        time.sleep(0.3)  # rooms spread over several heartbeat limits (1 s)
        cluster.send(room, requests)
        for state in cluster.wait_decode(room, timeout_s=60).values():
            assert state.status is RoomStatus.SUCCESS, (room, state.reason)
        assert check_sim(cluster, SEED, requests) == []
    for rank in [*cluster.prefill, *cluster.decode]:
        assert cluster.metric(rank.rank_id, "pd_transfer_heartbeat_misses_total") == 0, cluster.logs()


def _transferring(cluster, room: int):
    decode = cluster.clients[cluster.decode[0].rank_id]
    prefill = cluster.clients[cluster.prefill[0].rank_id]
    decode.expect(room, cluster.bootstrap, list(range(16, 24)))
    wait_status(decode, room, [RoomStatus.WAITING_FOR_INPUT], timeout_s=60)
    prefill.send(room, list(range(0, 4)), last_chunk=False)
    wait_status(prefill, room, [RoomStatus.TRANSFERRING], timeout_s=60)
    return prefill


def test_a_killed_decode_sidecar_still_fails_its_rooms_within_the_bound(starved, deployment):
    cluster = _pair(deployment)
    prefill = _transferring(cluster, 1)
    cluster.sidecars[cluster.decode[0].rank_id].kill()
    started = time.monotonic()
    state = prefill.wait(1, timeout_s=30)
    assert time.monotonic() - started < LOST_WITHIN_S
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason


def test_a_stopped_decode_sidecar_is_still_declared_lost(starved, deployment):
    cluster = _pair(deployment)
    prefill = _transferring(cluster, 1)
    sidecar = cluster.sidecars[cluster.decode[0].rank_id]
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        state = prefill.wait(1, timeout_s=30)
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
    assert state.status is RoomStatus.FAILED and state.code_text == "peer_lost", state.reason
    assert "is stopped" in state.reason, state.reason
