"""Every metric name the dashboard, the alert rules and the scrape config use is exported.

Names are the ``pd_transfer_[a-z_]+`` identifiers in every string of those files;
histograms count only with a ``_bucket``/``_sum``/``_count`` suffix (a bare histogram name
selects nothing), counters only with ``_total``.
"""

import yaml
from deploy_files import KUBERNETES, PROMETHEUS, metric_names_in, unexported

from pd_transfer.observability.metrics import METRIC_NAMES


def test_metric_names_list_every_family_the_registry_exports(families):
    assert set(METRIC_NAMES) == set(families)


def test_checker_rejects_unknown_bare_histogram_and_suffixless_counter_names(families):
    names = {
        "pd_transfer_nope",
        "pd_transfer_transfer_duration_seconds",
        "pd_transfer_transfers",
        "pd_transfer_rooms_bucket",
        "pd_transfer_transfer_duration_seconds_bucket",
        "pd_transfer_transfers_total",
        "pd_transfer_rooms",
    }
    assert unexported(names, METRIC_NAMES, families) == [
        "pd_transfer_nope",
        "pd_transfer_rooms_bucket",
        "pd_transfer_transfer_duration_seconds",
        "pd_transfer_transfers",
    ]


def test_dashboard_uses_only_exported_metrics(dashboard, families):
    names = metric_names_in(dashboard)
    assert names
    assert unexported(names, METRIC_NAMES, families) == []


def test_alert_rules_use_only_exported_metrics(alert_rules, families):
    names = metric_names_in(alert_rules)
    assert names
    assert unexported(names, METRIC_NAMES, families) == []


def test_prometheus_rule_and_scrape_config_use_only_exported_metrics(scrape_config, families):
    rule = yaml.safe_load((KUBERNETES / "prometheusrule.yaml").read_text())
    names = metric_names_in(rule) | metric_names_in(scrape_config)
    assert unexported(names, METRIC_NAMES, families) == []


def test_every_deploy_file_uses_only_exported_metrics(families):
    # catch-all for files added later (a recording rule, another dashboard)
    for path in sorted(PROMETHEUS.parent.rglob("*")):
        if path.is_file():
            names = metric_names_in(path.read_text())
            assert unexported(names, METRIC_NAMES, families) == [], path
