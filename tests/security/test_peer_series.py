"""A departed peer's labelled metric series leave the scrape after the grace period.

Prefill TP 1 and decode TP 1 (shared secret) move a room, so the prefill
sidecar holds series labelled ``peer="decode[pp0,tp0]"``. The decode sidecar
is killed; the prefill declares it lost. Its series stay through the grace
period (``peer_series_grace_s``, 4 s here through the environment) and are
gone from ``/metrics`` after it, while the totals without a peer label keep
counting the room.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hostile_wire import wait_for
from prometheus_client.parser import text_string_to_metric_families
from secure_cluster import SECRET_HEX, ranks, requests, start, write_secret

from pd_transfer.client import RoomStatus
from pd_transfer.layout.geometry import Role

PREFILL, DECODE = "prefill[pp0,tp0]", "decode[pp0,tp0]"
GRACE_S = 4.0


def _series_of(cluster, rank: str, peer: str) -> list[str]:
    status, text = cluster.http(rank, "/metrics")
    assert status == 200
    return [
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("peer") == peer
    ]


def _peer_state(cluster, rank: str, peer: str) -> str:
    status, text = cluster.http(rank, "/status")
    assert status == 200
    states = [p["state"] for p in json.loads(text)["peers"] if p["peer"] == peer]
    return states[-1] if states else ""


@pytest.fixture
def cluster():
    workdir = Path(tempfile.mkdtemp(prefix="pdt-"))
    secret = write_secret(workdir, "secret", SECRET_HEX)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PD_TRANSFER_PEER_SERIES_GRACE_S", str(GRACE_S))
        made = start(workdir, ranks(Role.PREFILL, 1), ranks(Role.DECODE, 1), secret)
    yield made
    made.close()
    shutil.rmtree(workdir, ignore_errors=True)


def test_the_series_of_a_departed_peer_go_after_the_grace_period(cluster):
    wanted = requests(1)
    cluster.expect(1, wanted)
    cluster.send(1, wanted)
    states = cluster.wait_decode(1)
    assert all(s.status is RoomStatus.SUCCESS for s in states.values()), cluster.logs()
    held = _series_of(cluster, PREFILL, DECODE)
    assert len(held) >= 3, held  # transfers, in-flight bytes, heartbeat age at least

    cluster.sidecars[DECODE].kill()
    wait_for(lambda: _peer_state(cluster, PREFILL, DECODE) == "lost", 10, "the decode peer lost")
    assert _series_of(cluster, PREFILL, DECODE), "removed before the grace period"
    wait_for(
        lambda: not _series_of(cluster, PREFILL, DECODE), GRACE_S + 10, "the departed peer's series removed"
    )
    assert cluster.metric(PREFILL, "pd_transfer_transfers_total", role="prefill", outcome="success") == 1
    assert cluster.metric(PREFILL, "pd_transfer_peers", state="lost") == 1
