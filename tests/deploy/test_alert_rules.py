"""deploy/prometheus: alert rules carry severity and runbook links, cover the failure modes
operators page on, and the scrape config finds the sidecars."""

import re

import pytest
from deploy_files import PROMETHEUS, ROOT

RUNBOOK = re.compile(r"^docs/operations\.md#([a-z0-9-]+)$")  # relative to the source tree


def _rules(alert_rules):
    return [rule for group in alert_rules["groups"] for rule in group["rules"]]


def _by_name(alert_rules):
    return {rule["alert"]: rule for rule in _rules(alert_rules)}


def _github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_rule_has_a_severity_and_summary_description_runbook(alert_rules):
    rules = _rules(alert_rules)
    assert rules
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert RUNBOOK.match(annotations["runbook_url"]), annotations["runbook_url"]


def test_alert_names_are_unique(alert_rules):
    names = [rule["alert"] for rule in _rules(alert_rules)]
    assert len(names) == len(set(names))


def test_failure_rate_alert_is_per_reason(alert_rules):
    expr = _by_name(alert_rules)["PdTransferFailureRateHigh"]["expr"]
    assert "sum by (role, reason) (" in expr and "pd_transfer_transfer_failures_total" in expr
    assert "pd_transfer_transfers_total" in expr


@pytest.mark.parametrize(
    "alert, needle",
    [
        ("PdTransferPeerLost", 'pd_transfer_peers{state="lost"}'),
        ("PdTransferPeerFlapping", "pd_transfer_peer_heartbeat_misses_total"),
        ("PdTransferPeerRejected", 'pd_transfer_peers{state="rejected"}'),
        ("PdTransferSidecarNotReady", 'probe_success{job="blackbox-pd-transfer-readyz"}'),
        ("PdTransferSidecarNotReady", 'kube_pod_init_container_status_ready{container="pd-transfer"}'),
        ("PdTransferBuildInfoMissing", "unless on (job, instance) pd_transfer_build_info"),
        ("PdTransferSidecarDown", "up{"),
        (
            "PdTransferRoomsFailed",
            'pd_transfer_transfer_failures_total{reason!~"aborted|shutting_down|timeout"}',
        ),
        ("PdTransferAuthFailures", "pd_transfer_auth_failures_total"),
        ("PdTransferInsecure", "pd_transfer_insecure == 1"),
    ],
)
def test_required_alert_watches_its_signal(alert_rules, alert, needle):
    assert needle in _by_name(alert_rules)[alert]["expr"]


def test_promql_brackets_and_quotes_balance(alert_rules):
    pairs = {")": "(", "]": "[", "}": "{"}
    for rule in _rules(alert_rules):
        expr, stack = rule["expr"], []
        assert expr.count('"') % 2 == 0, rule["alert"]
        for char in re.sub(r'"[^"]*"', '""', expr):
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], rule["alert"]
        assert not stack, rule["alert"]


def test_runbook_anchors_are_sections_of_the_operations_doc(alert_rules):
    doc = ROOT / "docs" / "operations.md"
    if not doc.exists():
        pytest.skip("docs/operations.md is not written yet")
    anchors = {
        _github_anchor(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")
    }
    wanted = {RUNBOOK.match(r["annotations"]["runbook_url"]).group(1) for r in _rules(alert_rules)}
    assert wanted <= anchors, f"sections missing in docs/operations.md: {sorted(wanted - anchors)}"


def test_scrape_config_loads_the_rules_and_finds_sidecars_both_ways(scrape_config):
    for rule_file in scrape_config["rule_files"]:
        assert (PROMETHEUS / rule_file).is_file()
    jobs = {job["job_name"]: job for job in scrape_config["scrape_configs"]}
    kubernetes = jobs["pd-transfer"]
    assert kubernetes["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep_port = {
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "metrics",
        "action": "keep",
    }
    assert keep_port in kubernetes["relabel_configs"]
    static = jobs["pd-transfer-static"]["static_configs"]
    assert all(target.rsplit(":", 1)[1].startswith("94") for group in static for target in group["targets"])
    readyz = jobs["blackbox-pd-transfer-readyz"]["static_configs"][0]["targets"]
    assert all(target.endswith("/readyz") for target in readyz)


def test_alerts_select_the_scrape_jobs_that_exist(alert_rules, scrape_config):
    jobs = {job["job_name"] for job in scrape_config["scrape_configs"]}
    for rule in _rules(alert_rules):
        for pattern in re.findall(r'job=~?"([^"]+)"', rule["expr"]):
            assert any(re.fullmatch(pattern, job) for job in jobs), (rule["alert"], pattern)
