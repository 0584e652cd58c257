"""Where the deployment files live, how to read them, and which metric names the daemon
exports (from its own registry, not a hand-kept list)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from pd_transfer.observability.metrics import SidecarMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "pd-transfer.json"
SYSTEMD_UNIT = DEPLOY / "systemd" / "pd-transfer@.service"
SIDECARS = ROOT / "configs" / "sidecars"

_METRIC_NAME = re.compile(r"pd_transfer_[a-z_]+")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_yaml_docs(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def strings_in(tree) -> list[str]:
    """Every string value in a parsed YAML/JSON tree (expressions, queries, annotations)."""
    if isinstance(tree, str):
        return [tree]
    if isinstance(tree, dict):
        return [s for value in tree.values() for s in strings_in(value)]
    if isinstance(tree, list):
        return [s for value in tree for s in strings_in(value)]
    return []


def metric_names_in(tree) -> set[str]:
    return {m for text in strings_in(tree) for m in _METRIC_NAME.findall(text)}


def exported_families() -> dict[str, str]:
    """Family name as in METRIC_NAMES -> type, from a fresh SidecarMetrics registry."""
    registry = CollectorRegistry()
    SidecarMetrics(registry, "prefill")
    families = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        families[name] = family.type
    return families


def unexported(names: set[str], metric_names: tuple[str, ...], families: dict[str, str]) -> list[str]:
    """Names a PromQL expression uses that select nothing the daemon exports.

    Counters and gauges must appear as listed (``pd_transfer_transfers_total``); histograms only
    with a sample suffix (``pd_transfer_transfer_duration_seconds_bucket``): a bare histogram
    family name selects no series.
    """
    bad = []
    for name in sorted(names):
        base = next((name[: -len(s)] for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is not None and base in metric_names and families.get(base) == "histogram":
            continue
        if name in metric_names and families.get(name) != "histogram":
            continue
        bad.append(name)
    return bad
