"""deploy/prometheus: alert rules carry severity and runbook links, cover the failure modes
operators page on, and the scrape config finds the sidecars."""

import re
import shutil
import subprocess

import pytest
import yaml
from deploy_files import PROMETHEUS, ROOT

from pd_transfer.observability import runbooks

# a runbook link opens a section of docs/operations.md on a sidecar (GET /runbooks/<name>):
# the alert's own sidecar, or the first one up where its labels name none
OWN_SIDECAR = "http://{{ $labels.instance }}/runbooks/"
FIRST_SIDECAR_UP = (
    'http://{{ with query "pd_transfer_build_info and on (job, instance) (up == 1)" | sortByLabel "instance" }}'
    '{{ . | first | label "instance" }}{{ end }}/runbooks/'
)
RUNBOOK = re.compile(rf"^(?:{re.escape(OWN_SIDECAR)}|{re.escape(FIRST_SIDECAR_UP)})([a-z0-9-]+)$")


def _rules(alert_rules):
    return [rule for group in alert_rules["groups"] for rule in group["rules"]]


def _by_name(alert_rules):
    return {rule["alert"]: rule for rule in _rules(alert_rules)}


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


def test_runbook_links_name_sections_of_the_operations_doc(alert_rules):
    sections = runbooks.sections((ROOT / "docs" / "operations.md").read_text())
    wanted = {RUNBOOK.match(r["annotations"]["runbook_url"]).group(1) for r in _rules(alert_rules)}
    assert wanted <= set(sections), (
        f"sections missing in docs/operations.md: {sorted(wanted - set(sections))}"
    )


def test_alerts_that_keep_no_sidecar_instance_link_to_the_first_sidecar_up(alert_rules):
    # these aggregate the instance away, or their instance is not a sidecar's HTTP port
    # (a target that is down or not a sidecar, a probe URL, kube-state-metrics)
    elsewhere = {
        "PdTransferFailureRateHigh",
        "PdTransferProtocolVersionSkew",
        "PdTransferSidecarDown",
        "PdTransferBuildInfoMissing",
        "PdTransferSidecarNotReady",
    }
    for rule in _rules(alert_rules):
        url = rule["annotations"]["runbook_url"]
        own = url.startswith(OWN_SIDECAR)
        assert own == (rule["alert"] not in elsewhere), rule["alert"]
        if own:  # the expression keeps the instance label it links to
            assert (
                "sum by (" not in rule["expr"]
                or "instance" in rule["expr"].split("sum by (")[1].split(")")[0]
            )


def _documented_substitution() -> str:
    doc = (ROOT / "docs" / "operations.md").read_text()
    (line,) = [line.strip() for line in doc.splitlines() if line.strip().startswith("sed -E -i ")]
    return line


@pytest.mark.skipif(shutil.which("sed") is None, reason="no sed")
def test_the_documented_substitution_points_every_link_at_published_docs(tmp_path):
    rules = tmp_path / "alerts.yml"
    shutil.copy(PROMETHEUS / "alerts.yml", rules)
    subprocess.run(["bash", "-c", _documented_substitution()], cwd=tmp_path, check=True, timeout=30)
    before = {
        r["alert"]: r
        for g in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    after = [r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    assert len(after) == len(before)
    for rule in after:
        name = RUNBOOK.match(before[rule["alert"]]["annotations"]["runbook_url"]).group(1)
        assert rule["annotations"]["runbook_url"] == f"https://docs.example.com/pd-transfer/operations#{name}"
        assert {k: v for k, v in rule.items() if k != "annotations"} == {
            k: v for k, v in before[rule["alert"]].items() if k != "annotations"
        }


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
