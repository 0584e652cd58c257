"""Prefill rank 0 whose worker left keeps its bootstrap port answering: a decode holding
the wrong secret is refused with ``auth_failed`` and counted, one holding the right secret
learns at once that the prefill's worker is gone (and looks again often), and the table is
served again once a worker registers."""

import json
import re
import time
import urllib.error
import urllib.request

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
    assert re.search(
        rf"refused the request: prefill rank 0's worker {re.escape(P0)} is gone: its connection to "
        r".* closed at .*; it serves no rank table until a worker registers with it again$",
        state.reason,
    ), state.reason
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


def _readyz_reasons(address: str) -> str:
    try:
        with urllib.request.urlopen(address + "/readyz", timeout=5) as response:
            body = response.read()
    except urllib.error.HTTPError as err:  # 503: not ready
        body = err.read()
    return " ".join(json.loads(body)["reasons"])


def test_a_decode_configured_with_the_instance_looks_again_often_while_its_worker_is_gone(worker_left):
    """Its resolutions are refused with worker_lost at once; the waits between them stay
    short (at most 2 s), so that rooms stop failing soon after a worker registers again.
    Without that cap the 6th wait would be drawn between 8 and 16 s."""
    sidecar = Sidecar(
        worker_left.workdir,
        "decode",
        "decode-configured",
        {
            "http_port": 0,
            "secret_file": str(worker_left.secret),
            "prefill_bootstraps": [worker_left.bootstrap],
        },
    )
    geometry = ranks(Role.DECODE, 1)[0]
    pools = allocate_pools(geometry, "t-gone-configured")
    try:
        address = sidecar.wait_ready()["http_address"]
        with Client(
            sidecar.endpoint, "configured", timeout_s=30, secret_file=str(worker_left.secret)
        ) as client:
            client.register(geometry, pools.handles)

            def six_tries():
                reasons = _readyz_reasons(address)
                match = re.search(r"next try in (\d+\.\d) s \((\d+) failed tries\): (.*)", reasons)
                return match if match and int(match.group(2)) >= 6 else None

            match = _until(six_tries, 90, "six refused resolutions")
    finally:
        sidecar.stop()
        pools.close()
    assert float(match.group(1)) <= 2.0, match.group(0)
    assert f"prefill rank 0's worker {P0} is gone" in match.group(3), match.group(0)
