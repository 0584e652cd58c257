"""Prefill rank 0 whose worker left keeps its bootstrap port answering: a decode holding
the wrong secret is refused with ``auth_failed`` and counted, one holding the right secret
learns at once that the prefill's worker is gone, and the table is served again once a
worker registers."""

import json
import time

import pytest
from cluster import Sidecar
from secure_cluster import SECRET_HEX, WRONG_HEX, metric, ranks, run_with, security, start, write_secret

from pd_transfer.agent.bootstrap import fetch_table
from pd_transfer.client import Client, RoomStatus, allocate_pools
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role

P0 = "prefill[pp0,tp0]"
AUTH_FAILURES = "pd_transfer_auth_failures_total"


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)
    return value


def _room_state(cluster, name: str, secret_file, room: int):
    """A decode sidecar of its own (secret ``secret_file``), whose worker expects ``room``
    from the prefill instance; the room's state after at most 20 s. The bootstrap timeout
    is 60 s: a room still resolving at 20 s got no answer."""
    sidecar = Sidecar(
        cluster.workdir,
        "decode",
        f"decode-{name}",
        {"http_port": 0, "bootstrap_timeout_s": 60.0, "secret_file": str(secret_file)},
    )
    geometry = ranks(Role.DECODE, 1)[0]
    pools = allocate_pools(geometry, f"t-gone-{name}")
    try:
        sidecar.wait_ready()
        with Client(sidecar.endpoint, name, timeout_s=30, secret_file=str(secret_file)) as client:
            client.register(geometry, pools.handles)
            client.expect(room, cluster.bootstrap, [0, 1])
            return client.wait(room, timeout_s=20)
    finally:
        sidecar.stop()
        pools.close()


@pytest.fixture
def worker_left(workdir):
    """A secured TP 1 prefill instance whose worker registered and then left."""
    secret = write_secret(workdir, "gone-secret", SECRET_HEX)
    cluster = start(workdir, ranks(Role.PREFILL, 1), [], secret)
    cluster.secret, cluster.wrong = secret, write_secret(workdir, "gone-wrong", WRONG_HEX)
    try:
        cluster.clients[P0].close()  # its connection closes: the worker is gone
        _until(
            lambda: "is gone" in " ".join(json.loads(cluster.http(P0, "/readyz")[1])["reasons"]),
            20,
            "the prefill sidecar seeing its worker gone",
        )
        yield cluster
    finally:
        cluster.close()


def test_a_wrong_secret_is_refused_and_counted_after_rank_0s_worker_left(worker_left):
    before = metric(worker_left, P0, AUTH_FAILURES, role="prefill", reason="auth_failed")
    state = _room_state(worker_left, "wrong", worker_left.wrong, 3)
    assert state.status is RoomStatus.FAILED and state.code is Reason.AUTH_FAILED, state
    assert "did not prove it holds the shared secret" in state.reason, state.reason
    assert metric(worker_left, P0, AUTH_FAILURES, role="prefill", reason="auth_failed") == before + 1


def test_the_right_secret_learns_the_worker_is_gone_and_the_table_comes_back(worker_left):
    state = _room_state(worker_left, "right", worker_left.secret, 4)
    assert state.status is RoomStatus.FAILED and state.code is Reason.WORKER_LOST, state
    assert "prefill rank 0's worker is gone" in state.reason, state.reason
    assert "until a worker registers with it again" in state.reason, state.reason
    before = metric(worker_left, P0, AUTH_FAILURES)
    # the worker registers again: the same port serves the complete table
    geometry = worker_left.prefill[0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PD_TRANSFER_SECRET_FILE", str(worker_left.secret))
        client = worker_left.clients[P0] = Client(worker_left.sidecars[P0].endpoint, P0, timeout_s=20)
    client.register(geometry, worker_left.pools[P0].handles)
    table = run_with(security(SECRET_HEX), lambda ctx: fetch_table(ctx, worker_left.bootstrap, "ok", 10.0))
    assert table.complete and [e.geometry.rank_id for e in table.entries] == [P0]
    assert metric(worker_left, P0, AUTH_FAILURES) == before
