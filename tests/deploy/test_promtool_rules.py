"""deploy/prometheus/alerts.yml under promtool: the rules load, and every alert fires on the
series an operator meets (counters born at their first event) and stays quiet otherwise.

The cases are tests/deploy/promtool/alerts_test.yml, plain promtool unit tests that run as
shipped (``promtool test rules tests/deploy/promtool/alerts_test.yml``); a test here keeps
each expected alert's ``runbook_url`` what its rule's template links to. promtool comes with Debian's ``prometheus`` package
(``.ci/run`` installs it where it can); without it these tests skip and say so.
"""

import json
import re
import shutil
import subprocess

import pytest
import yaml
from deploy_files import DASHBOARD, KUBERNETES, PROMETHEUS, ROOT

CASES = ROOT / "tests" / "deploy" / "promtool" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)


def _rules() -> dict[str, dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def _cases() -> dict:
    return yaml.safe_load(CASES.read_text())


def test_every_alert_has_a_firing_and_a_quiet_promtool_case():
    firing, quiet = set(), set()
    for test in _cases()["tests"]:
        for case in test["alert_rule_test"]:
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert set(_rules()) - firing == set(), "alerts no case sees firing"
    assert set(_rules()) - quiet == set(), "alerts no case sees quiet"
    assert firing | quiet <= set(_rules()), "cases of alerts that do not exist"


def test_the_cases_test_the_shipped_rules_file():
    assert [(CASES.parent / f).resolve() for f in _cases()["rule_files"]] == [
        (PROMETHEUS / "alerts.yml").resolve()
    ]


@needs_promtool
@pytest.mark.parametrize("path", [PROMETHEUS / "alerts.yml", KUBERNETES / "prometheusrule.yaml"])
def test_promtool_checks_the_rules(path, tmp_path):
    if path.suffix == ".yaml":  # the PrometheusRule's spec is a rules file
        rules = tmp_path / "rules.yml"
        rules.write_text(yaml.safe_dump({"groups": yaml.safe_load(path.read_text())["spec"]["groups"]}))
        path = rules
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _sidecars(test: dict) -> set[str]:
    """The instances of a case's input series that export pd_transfer_build_info."""
    return {
        m.group(1)
        for series in test["input_series"]
        if series["series"].startswith("pd_transfer_build_info{")
        for m in [re.search(r'instance="([^"]+)"', series["series"])]
    }


def test_every_expected_alert_carries_its_rules_runbook_link_rendered():
    """What promtool checks the rules render to: the alert's own sidecar where the rule
    links to its instance, else one of the case's sidecars; the section, the rule's."""
    rules = _rules()
    for test in _cases()["tests"]:
        for case in test["alert_rule_test"]:
            for alert in case.get("exp_alerts") or []:
                template = rules[case["alertname"]]["annotations"]["runbook_url"]
                host, _, section = (
                    alert["exp_annotations"]["runbook_url"].removeprefix("http://").partition("/")
                )
                assert section == "runbooks/" + template.rsplit("/runbooks/", 1)[1], case["alertname"]
                if template.startswith("http://{{ $labels.instance }}/"):
                    assert host == alert["exp_labels"]["instance"], case["alertname"]
                else:
                    assert host in _sidecars(test), case["alertname"]


@needs_promtool
def test_promtool_runs_the_shipped_unit_test_file_as_an_operator_would():
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(CASES)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_promtool_checks_the_shipped_scrape_config():
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(PROMETHEUS / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    values = {"$__rate_interval": "1m", "$__range": "1h", "$job": ".*", "$instance": ".*", "$role": ".*"}
    exprs = [
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel.get("targets", [])
    ]
    for name in sorted(values, key=len, reverse=True):
        exprs = [expr.replace(name, values[name]) for expr in exprs]
    assert exprs and not [e for e in exprs if "$" in e]
    rules = tmp_path / "dashboard.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "dashboard",
                        "rules": [
                            {"record": f"dashboard:query{i}", "expr": expr} for i, expr in enumerate(exprs)
                        ],
                    }
                ]
            }
        )
    )
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
