"""Fixtures of the deployment tests: the files under deploy/, parsed once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from deploy_files import DASHBOARD, KUBERNETES, PROMETHEUS, exported_families, load_yaml_docs


@pytest.fixture(scope="session")
def k8s_docs() -> list[tuple[Path, dict]]:
    return [
        (path, doc)
        for path in sorted(KUBERNETES.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in load_yaml_docs(path)
    ]


@pytest.fixture(scope="session")
def kustomization() -> dict:
    return yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())


@pytest.fixture(scope="session")
def statefulsets(k8s_docs) -> dict[str, dict]:
    """Role (the pods' component label) -> StatefulSet."""
    found = {}
    for _, doc in k8s_docs:
        if doc.get("kind") == "StatefulSet":
            role = doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            found[role] = doc
    return found


@pytest.fixture(scope="session")
def alert_rules() -> dict:
    return yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())


@pytest.fixture(scope="session")
def scrape_config() -> dict:
    # the shipped config and the Kubernetes job shipped beside it, as one
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    kubernetes = yaml.safe_load((PROMETHEUS / "kubernetes-scrape.yml").read_text())
    config["scrape_configs"] += kubernetes["scrape_configs"]
    return config


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="session")
def families() -> dict[str, str]:
    return exported_families()
