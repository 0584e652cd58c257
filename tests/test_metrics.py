"""pd_transfer.observability.metrics: the series whose labels are known ahead exist at 0 before any event,
so an alert's increase() sees the first event and a panel shows 0, not "No data"."""

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_transfer.agent.admission import Admission
from pd_transfer.config.sidecar import SidecarConfig
from pd_transfer.errors import Reason
from pd_transfer.layout.geometry import Role
from pd_transfer.observability.metrics import (
    BAD_FRAME_REASONS,
    DOORBELL_EVENTS,
    LIMITS,
    LISTENING_SOCKETS,
    SidecarMetrics,
)

PACKAGE = Path(__file__).resolve().parents[1] / "pd_transfer"


def _samples(metrics: SidecarMetrics) -> dict[tuple, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_bounded_label_sets_are_exported_at_zero_before_any_event(role):
    samples = _samples(SidecarMetrics(CollectorRegistry(), role))
    for reason in BAD_FRAME_REASONS:
        assert _value(samples, "pd_transfer_bad_frames_total", role=role, reason=reason) == 0
    for limit in LIMITS:
        assert _value(samples, "pd_transfer_limit_rejections_total", role=role, limit=limit) == 0
    for event in DOORBELL_EVENTS[role]:
        assert _value(samples, "pd_transfer_doorbells_total", role=role, event=event) == 0
    assert _value(samples, "pd_transfer_heartbeat_misses_total", role=role) == 0
    for socket in LISTENING_SOCKETS[role]:
        assert _value(samples, "pd_transfer_connections_closed_total", role=role, socket=socket) == 0
    assert _value(samples, "pd_transfer_verdicts_total", role=role, outcome="accepted", reason="none") == 0
    assert _value(samples, "pd_transfer_transfer_duration_seconds_count", role=role) == 0


def test_an_accepted_peer_has_its_loss_and_transfer_series_at_zero():
    metrics = SidecarMetrics(CollectorRegistry(), "prefill")
    assert not any(dict(labels).get("peer") == "decode[pp0,tp0]" for _, labels in _samples(metrics))
    made = metrics.peer_accepted("decode[pp0,tp0]", "shm", "sliced")
    samples = _samples(metrics)
    assert (
        _value(samples, "pd_transfer_peer_heartbeat_misses_total", role="prefill", peer="decode[pp0,tp0]")
        == 0
    )
    for outcome in ("success", "failed"):
        assert (
            _value(
                samples,
                "pd_transfer_peer_transfers_total",
                role="prefill",
                peer="decode[pp0,tp0]",
                outcome=outcome,
            )
            == 0
        )
        assert (
            _value(
                samples,
                "pd_transfer_transfers_total",
                role="prefill",
                transport="shm",
                mode="sliced",
                outcome=outcome,
            )
            == 0
        )
    # the per-peer series are returned, for their removal once the peer is gone
    assert {labels for _, labels in made if "decode[pp0,tp0]" in labels} == {
        ("prefill", "decode[pp0,tp0]"),
        ("prefill", "decode[pp0,tp0]", "success"),
        ("prefill", "decode[pp0,tp0]", "failed"),
    }


def test_bad_frame_reasons_are_reason_codes():
    assert set(BAD_FRAME_REASONS) <= {r.value for r in Reason}


def test_limits_are_every_limit_the_sidecar_counts_and_config_keys():
    # the names passed to Observer.limit_refused in the code, and the admission limiters'
    used = {
        m
        for path in PACKAGE.rglob("*.py")
        for m in re.findall(r'limit_refused\(\s*"(\w+)"', path.read_text())
    }
    admission = Admission(SidecarConfig(role=Role.PREFILL))
    for limiter in admission.limiters():
        used |= {limiter.per_peer_name} | ({limiter.total_name} if limiter.total_name else set())
    assert used == set(LIMITS)
    fields = set(SidecarConfig.__dataclass_fields__)
    assert set(LIMITS) <= fields
