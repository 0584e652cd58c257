"""What an operator meets on a first deployment, with real sidecars and real scrapes: the
alerting series exist at 0 before any event (and a real Prometheus fires on the first bad
frame), a rejected prefill instance is retried with backoff rather than in a tight loop,
and a steady-state sidecar's log says what changed, not the same thing every second."""

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import zmq
from cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families
from prometheus_server import start_prometheus

from pd_transfer.client import Client
from pd_transfer.client.errors import AuthFailed
from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.observability.metrics import BAD_FRAME_REASONS, LIMITS

TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}
ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def _ranks(role, tp, **kwargs):
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2, **kwargs}
    return build_instance(model_from_table(dict(TINY), "tiny"), role, tp, **shape)


def _series(cluster: Cluster, rank: str) -> dict[tuple, float]:
    """Every sample of one scrape of ``rank``'s /metrics: (name, sorted labels) -> value."""
    status, text = cluster.http(rank, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _get(series, name, **labels):
    return series.get((name, tuple(sorted(labels.items()))))


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def _send_garbage(control_address: str) -> None:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    # close() waits this long for the frame to leave: on a busy host the ZeroMQ handshake
    # alone can take over a second, and a frame still queued then is dropped unsent
    socket.setsockopt(zmq.LINGER, 30_000)
    socket.connect(control_address)
    socket.send(b"\xc1 this is not msgpack")
    socket.close()


def test_alerting_series_exist_at_zero_before_any_event_and_count_the_first(cluster_factory):
    prefill, decode = _ranks(Role.PREFILL, 1), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, decode_config={"prefill_bootstraps": "this"}, attach=False)
    p, d = prefill[0].rank_id, decode[0].rank_id
    for rank, role in ((p, "prefill"), (d, "decode")):
        series = _series(cluster, rank)
        for reason in BAD_FRAME_REASONS:
            assert _get(series, "pd_transfer_bad_frames_total", role=role, reason=reason) == 0
        for limit in LIMITS:
            assert _get(series, "pd_transfer_limit_rejections_total", role=role, limit=limit) == 0
        assert _get(series, "pd_transfer_heartbeat_misses_total", role=role) == 0
        assert _get(series, "pd_transfer_peers", role=role, state="lost") == 0
    # once the pair is accepted, each side's loss and transfer series of the other exist at 0
    cluster.attach_all()
    _until(
        lambda: _get(_series(cluster, d), "pd_transfer_peers", role="decode", state="accepted") == 1,
        20,
        "the decode side accepts the prefill rank",
    )
    _until(
        lambda: _get(_series(cluster, p), "pd_transfer_peers", role="prefill", state="accepted") == 1,
        20,
        "the prefill side accepts the decode rank",
    )
    for rank, role, peer in ((p, "prefill", d), (d, "decode", p)):
        series = _series(cluster, rank)
        assert _get(series, "pd_transfer_peer_heartbeat_misses_total", role=role, peer=peer) == 0
        outcomes = {
            dict(labels)["outcome"]: value
            for (name, labels), value in series.items()
            if name == "pd_transfer_peer_transfers_total" and dict(labels)["peer"] == peer
        }
        assert outcomes == {"success": 0, "failed": 0}
    # one garbage frame on the control socket is counted: a step from 0 that increase() sees
    # (a sidecar with a shared secret counts a frame before the handshake as unauthenticated)
    _send_garbage(cluster.ready[p]["control_address"])
    _until(
        lambda: (
            _get(
                _series(cluster, p), "pd_transfer_bad_frames_total", role="prefill", reason="unauthenticated"
            )
            == 1
        ),
        20,
        "the garbage frame is counted",
    )


def _prometheus_json(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
)
def test_a_real_prometheus_fires_on_the_first_garbage_frame_and_the_first_refused_handshake(
    cluster_factory, tmp_path
):
    prefill = _ranks(Role.PREFILL, 1)
    cluster = cluster_factory(prefill, [], attach=False)
    rank = prefill[0].rank_id
    target = cluster.ready[rank]["http_address"].removeprefix("http://")
    proc, base = start_prometheus(tmp_path, ALERTS, target)
    try:

        def scraped_at_zero():
            try:
                result = _prometheus_json(
                    base, "/api/v1/query", query='pd_transfer_bad_frames_total{reason="unauthenticated"}'
                )
            except (urllib.error.URLError, ConnectionError):
                return False  # still starting
            return [r["value"][1] for r in result["data"]["result"]] == ["0"]

        _until(scraped_at_zero, 60, "Prometheus scrapes the bad-frame series at 0")
        _send_garbage(cluster.ready[rank]["control_address"])

        def firing():
            alerts = _prometheus_json(base, "/api/v1/alerts")["data"]["alerts"]
            return [
                a
                for a in alerts
                if a["labels"]["alertname"] == "PdTransferBadFrames" and a["state"] == "firing"
            ]

        (alert,) = _until(firing, 60, "PdTransferBadFrames fires")
        assert alert["labels"]["reason"] == "unauthenticated" and alert["labels"]["role"] == "prefill"
        assert alert["labels"]["instance"] == target

        # a worker holding another secret is refused, and the authentication alert fires
        with Client(cluster.sidecars[rank].endpoint, "stranger", timeout_s=60, secret=b"x" * 32) as client:
            with pytest.raises(AuthFailed):
                client.poll(1)

        def auth_firing():
            alerts = _prometheus_json(base, "/api/v1/alerts")["data"]["alerts"]
            return [
                a
                for a in alerts
                if a["labels"]["alertname"] == "PdTransferAuthFailures"
                and a["state"] == "firing"
                and a["labels"]["reason"] == "auth_failed"  # the garbage frame fired "unauthenticated"
            ]

        (alert,) = _until(auth_firing, 60, "PdTransferAuthFailures fires for the wrong secret")
        assert alert["labels"]["role"] == "prefill" and alert["labels"]["instance"] == target
    except AssertionError as err:
        log = (tmp_path / "prometheus.log").read_text()[-2000:]
        raise AssertionError(f"{err}\n-- prometheus log:\n{log}") from None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_rejected_prefill_instance_is_retried_with_backoff_and_readyz_says_when(cluster_factory):
    prefill = _ranks(Role.PREFILL, 1)
    decode = _ranks(Role.DECODE, 1, kv_dtype="float16")
    cluster = cluster_factory(prefill, decode, decode_config={"prefill_bootstraps": "this"})
    d, p = decode[0].rank_id, prefill[0].rank_id

    def rejected(rank):
        return cluster.metric(rank, "pd_transfer_verdicts_total", outcome="rejected")

    _until(lambda: rejected(d) >= 1, 20, "the first rejection")
    time.sleep(4.0)
    # tries start at least 0.25, 0.5, 1 and 2 s apart after failures 1-4 (the lower halves of
    # their ceilings): at most 5 tries in the first 3.75 s, where a tight loop made about 40
    on_decode, on_prefill = rejected(d), rejected(p)
    assert 2 <= on_decode <= 5, on_decode
    assert on_prefill <= 6, on_prefill
    status, body = cluster.http(d, "/readyz")
    assert status == 503
    (reason,) = json.loads(body)["reasons"]
    assert re.match(
        rf"prefill instance {re.escape(cluster.bootstrap)}: next try in \d+\.\d s "
        rf"\(\d+ failed tries\): ",
        reason,
    ), reason
    assert "kv.layer[0-1].k.dtype: prefill=bfloat16 decode=float16" in reason
    # each side warns once; the same rejection again is steady state (debug)
    decode_log = _messages(cluster.sidecars[d].log.read_text())
    prefill_log = _messages(cluster.sidecars[p].log.read_text())
    assert sum(m.startswith(f"decode: prefill instance {cluster.bootstrap}: ") for m in decode_log) == 1, (
        decode_log
    )
    assert sum(m.startswith("prefill: rejected ") for m in prefill_log) == 1, prefill_log


def _messages(log_text: str) -> list[str]:
    """The messages of the info lines and above (warnings: nothing in steady state should
    warn either)."""
    return [
        json.loads(m.group(1))
        for line in log_text.splitlines()
        if re.search(r" level=(info|warning|error) ", line)
        for m in [re.search(r' msg=(".*?")(?: exc=|$)', line)]
        if m
    ]


def test_steady_state_sidecars_repeat_no_info_line(cluster_factory):
    # two prefill ranks: rank 1 announces itself to rank 0 every heartbeat_interval_s *
    # heartbeat_misses (1 s here), and both keep announcing
    prefill, decode = _ranks(Role.PREFILL, 2), _ranks(Role.DECODE, 1)
    cluster = cluster_factory(prefill, decode, decode_config={"prefill_bootstraps": "this"})
    _until(lambda: cluster.http(decode[0].rank_id, "/readyz")[0] == 200, 30, "decode ready")
    time.sleep(4.0)
    for sidecar in cluster.sidecars.values():
        messages = _messages(sidecar.log.read_text())
        assert messages, sidecar.name  # the parser reads this log
        repeated = {m: n for m, n in Counter(messages).items() if n > 1}
        assert repeated == {}, (sidecar.name, repeated)
