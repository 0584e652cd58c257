"""Operators' view: /metrics counters move with the right labels, /readyz follows the peers."""

import json
import time

import numpy as np
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout, Pool
from pd_transfer.observability.metrics import METRIC_NAMES

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}


def _ranks(role, tp, **kwargs):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples, name, **labels) -> float:
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _wait_status(cluster, rank, code, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = cluster.http(rank, "/readyz")
        if status == code or time.monotonic() > deadline:
            return status, json.loads(body)
        time.sleep(0.05)


def test_metrics_count_transfers_aborts_and_rejections_with_labels(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode)
    requests = {Pool.KV: (np.array([0, 1]), np.array([2, 3])), Pool.AUX: (np.array([0]), np.array([1]))}
    for room in (1, 2):
        cluster.expect(room, requests)
        cluster.send(room, requests)
        assert cluster.wait_decode(room)[decode[0].rank_id].status is RoomStatus.SUCCESS
    client = cluster.clients[decode[0].rank_id]
    client.expect(3, cluster.bootstrap, [4])
    while client.poll(3).status is RoomStatus.BOOTSTRAPPING:
        time.sleep(0.02)
    assert client.abort(3) is True
    bad = Cluster(cluster.workdir, [], _ranks(Role.DECODE, 1, kv_dtype="float16"))
    try:
        bad.clients[bad.decode[0].rank_id].expect(9, cluster.bootstrap, [0])
        assert bad.clients[bad.decode[0].rank_id].wait(9, 5).code_text == "peer_rejected"
        # the refused decode counts its prefill peer as rejected while it runs
        assert bad.metric(bad.decode[0].rank_id, "pd_transfer_peers", state="rejected") == 1
    finally:
        bad.close()

    status, text = cluster.http(prefill[0].rank_id, "/metrics")
    assert status == 200
    p = _samples(text)
    peer = decode[0].rank_id
    assert (
        _value(
            p,
            "pd_transfer_transfers_total",
            role="prefill",
            outcome="success",
            transport="shm",
            mode="sliced",
        )
        == 0
    )  # same TP: not sliced
    assert _value(p, "pd_transfer_transfers_total", role="prefill", outcome="success", transport="shm") == 2
    assert _value(p, "pd_transfer_peer_transfers_total", role="prefill", peer=peer, outcome="success") == 2
    assert _value(p, "pd_transfer_aborts_total", role="prefill", side="decode", reason="aborted") == 1
    assert _value(p, "pd_transfer_transfer_failures_total", role="prefill", reason="aborted") == 1
    assert (
        _value(p, "pd_transfer_peer_transfer_failures_total", role="prefill", peer=peer, reason="aborted")
        == 1
    )
    assert _value(p, "pd_transfer_verdicts_total", role="prefill", outcome="accepted") == 1
    assert (
        _value(p, "pd_transfer_verdicts_total", role="prefill", outcome="rejected", reason="dtype_mismatch")
        == 1
    )
    # the rejected decode ended its session: prefill keeps why, and nothing pages for it
    assert _value(p, "pd_transfer_peers", role="prefill", state="rejected") == 0
    assert _value(p, "pd_transfer_peers", role="prefill", state="lost") == 0
    peers = json.loads(cluster.http(prefill[0].rank_id, "/status")[1])["peers"]
    (left,) = [r for r in peers if r["state"] == "left"]
    assert left["reason"].startswith("rejected, then left (it closed its session"), left
    assert "cannot reconcile prefill (attn_tp=1) with decode (attn_tp=1)" in left["reason"], left
    assert _value(p, "pd_transfer_transfer_bytes_count", role="prefill") == 2
    assert _value(p, "pd_transfer_build_info") == 1
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {name.removesuffix("_total") for name in METRIC_NAMES} <= families
    d = _samples(cluster.http(decode[0].rank_id, "/metrics")[1])
    assert _value(d, "pd_transfer_aborts_total", role="decode", side="decode") == 1
    assert _value(d, "pd_transfer_rooms", role="decode", state="success") == 2


def test_readyz_turns_ready_when_the_peer_is_accepted_and_back_when_it_is_lost(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, decode_config={"prefill_bootstraps": "this"}, attach=False)
    status, body = cluster.http(decode[0].rank_id, "/readyz")
    assert status == 503
    assert json.loads(body)["reasons"][0] == "the worker has not registered its pools"
    cluster.attach_all()
    status, body = _wait_status(cluster, decode[0].rank_id, 200)
    assert status == 200 and body == {
        "ready": True,
        "reasons": [],
        "insecure": False,
        "unauthenticated_engine": None,
    }
    assert cluster.http(decode[0].rank_id, "/healthz")[0] == 200
    cluster.sidecars[prefill[0].rank_id].kill()
    status, body = _wait_status(cluster, decode[0].rank_id, 503)
    assert status == 503
    assert any("lost" in r or "no answer" in r or "incomplete" in r for r in body["reasons"]), body
    status_doc = json.loads(cluster.http(decode[0].rank_id, "/status")[1])
    assert status_doc["role"] == "decode" and status_doc["ready"] is False
    assert any(p["peer"] == prefill[0].rank_id and p["state"] == "lost" for p in status_doc["peers"])


def test_status_command_prints_peers_and_rooms(cluster_factory):
    import subprocess
    import sys

    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode)
    requests = {Pool.KV: (np.array([0]), np.array([1]))}
    cluster.expect(4, requests)
    cluster.send(4, requests)
    assert cluster.wait_decode(4)[decode[0].rank_id].status is RoomStatus.SUCCESS
    address = cluster.ready[prefill[0].rank_id]["http_address"].removeprefix("http://")
    result = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "status", "--addr", address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "(prefill, rank prefill[pp0,tp0]): ready" in result.stdout
    assert "decode[pp0,tp0]" in result.stdout and "accepted" in result.stdout
    from pd_transfer.transport.copy import native_loop as native_copy

    assert f"copies: {native_copy.describe(native_copy.AVAILABLE)}" in result.stdout
    assert "control sessions: 1" in result.stdout  # the decode peer's
    unreachable = subprocess.run(
        [sys.executable, "-m", "pd_transfer.cli", "status", "--addr", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert unreachable.returncode == 2 and "cannot read http://127.0.0.1:1/status" in unreachable.stderr


def test_without_the_native_copy_loop_a_sidecar_warns_copies_with_numpy_and_says_so(
    cluster_factory, monkeypatch
):
    monkeypatch.setenv("PD_TRANSFER_NATIVE_COPY", "0")  # the sidecars inherit it
    prefill, decode = _ranks(Role.PREFILL, 2), _ranks(Role.DECODE, 1, num_pages=8)
    cluster = cluster_factory(prefill, decode)
    rng = np.random.default_rng(8)
    requests = {
        Pool.KV: (rng.permutation(8)[:5], rng.permutation(8)[:5]),
        Pool.AUX: (np.array([1]), np.array([0])),
    }
    cluster.expect(9, requests)
    cluster.send(9, requests)
    assert cluster.wait_decode(9)[decode[0].rank_id].status is RoomStatus.SUCCESS
    assert cluster.verify(requests) == []
    status = json.loads(cluster.http(prefill[0].rank_id, "/status")[1])
    assert status["copies"] == "numpy (turned off by PD_TRANSFER_NATIVE_COPY)"
    assert "shm copies run through numpy" in cluster.logs()
