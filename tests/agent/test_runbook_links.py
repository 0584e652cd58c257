"""Every alert's runbook link opens its runbook section on a real sidecar.

A real Prometheus scrapes a real sidecar and evaluates the shipped alert rules'
annotations (each rule fired at once on the sidecar's own series, with the labels
its real expression keeps: the sidecar's instance, or none where the rule sums
over sidecars); the test then fetches every rendered ``runbook_url`` over HTTP and
gets the section of docs/operations.md it names. Names that are not sections,
path traversal included, are a 404.
"""

import json
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_server import start_prometheus

from pd_transfer.layout.geometry import Role
from pd_transfer.layout.presets import model_from_table
from pd_transfer.layout.rank_builder import build_instance
from pd_transfer.layout.views import Layout
from pd_transfer.observability import runbooks

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
OWN_SIDECAR = "http://{{ $labels.instance }}/runbooks/"
TINY = {
    "name": "tiny",
    "num_layers": 2,
    "layer_cycle": ["attention"],
    "attention": {"num_kv_heads": 4, "head_dim": 8},
}


def _prefill():
    shape = {"page_size": 4, "kv_layout": Layout.NHD, "num_pages": 8, "num_aux_rows": 2}
    return build_instance(model_from_table(dict(TINY), "tiny"), Role.PREFILL, 1, **shape)


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def _raw_get(address: str, path: bytes) -> tuple[int, str]:
    """GET ``path`` exactly as given (no client normalises it)."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def _fired_rules(tmp_path: Path) -> Path:
    """The shipped rules, each firing at once on the sidecar's series: a rule that links to
    its own sidecar keeps that sidecar's labels, any other keeps no label at all."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    for group in groups:
        for rule in group["rules"]:
            own = rule["annotations"]["runbook_url"].startswith(OWN_SIDECAR)
            rule["expr"] = "pd_transfer_build_info" if own else "count(pd_transfer_build_info)"
            rule.pop("for", None)
    path = tmp_path / "fired.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def _alerts(base: str) -> list[dict]:
    try:
        with urllib.request.urlopen(base + "/api/v1/alerts", timeout=5) as response:
            return json.loads(response.read())["data"]["alerts"]
    except (urllib.error.URLError, ConnectionError):
        return []  # still starting


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
)
def test_every_alerts_rendered_runbook_link_opens_its_section_on_a_real_sidecar(cluster_factory, tmp_path):
    cluster = cluster_factory(_prefill(), [], attach=False)
    (rank,) = cluster.ready
    target = cluster.ready[rank]["http_address"].removeprefix("http://")
    shipped = {
        rule["alert"]: rule["annotations"]["runbook_url"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
    }
    sections = runbooks.sections((ROOT / "docs" / "operations.md").read_text())
    proc, base = start_prometheus(tmp_path, _fired_rules(tmp_path), target)
    try:
        deadline = time.monotonic() + 90
        while {a["labels"]["alertname"] for a in _alerts(base) if a["state"] == "firing"} != set(shipped):
            assert time.monotonic() < deadline, "not every alert fired within 90 s"
            time.sleep(0.5)
        alerts = {a["labels"]["alertname"]: a for a in _alerts(base)}
    except AssertionError as err:
        raise AssertionError(
            f"{err}\n-- prometheus log:\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
        ) from None
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    for name, template in shipped.items():
        url = alerts[name]["annotations"]["runbook_url"]
        section = sections[template.rsplit("/runbooks/", 1)[1]]
        assert url == f"http://{target}/runbooks/{section.name}", (name, url)
        status, content_type, body = _get(url)
        assert status == 200 and content_type == "text/plain; charset=utf-8", (name, status, body)
        assert body.startswith(section.text), (name, body[:200])
        assert body.splitlines()[0] == "#" * section.level + " " + section.title


def test_the_runbook_lists_its_sections_and_serves_nothing_else(cluster_factory):
    cluster = cluster_factory(_prefill(), [], attach=False)
    (address,) = (ready["http_address"] for ready in cluster.ready.values())
    sections = runbooks.sections((ROOT / "docs" / "operations.md").read_text())
    status, _, listing = _get(address + "/runbooks/")
    assert status == 200
    assert [line.split()[0] for line in listing.splitlines()[2:]] == [f"/runbooks/{n}" for n in sections]
    status, _, body = _get(address + "/runbooks/peer-lost")
    assert status == 200 and body.startswith("### Peer lost\n") and "### Not ready" not in body
    for path in (
        b"/runbooks/no-such-section",
        b"/runbooks/../../../../etc/passwd",
        b"/runbooks/..%2f..%2f..%2fetc%2fpasswd",
        b"/runbooks/%2e%2e/%2e%2e/pyproject.toml",
        b"/runbooks/peer-lost/../../metrics",
        b"/runbooks//etc/passwd",
        b"/runbooks/Peer-Lost",
        b"/runbooks/" + b"a" * 4000,
        b"/runbooks/peer-lost\x00",
    ):
        status, body = _raw_get(address, path)
        assert status in (404, 400), (path, status, body)
        assert "root:" not in body and "[project]" not in body, path
    # a name that could be a section is echoed back; nothing else is
    assert "'no-such-section'" in _raw_get(address, b"/runbooks/no-such-section")[1]
    assert "passwd" not in _raw_get(address, b"/runbooks/..%2fetc%2fpasswd")[1]
    # the sidecar serves on
    assert _get(address + "/healthz")[0] == 200
