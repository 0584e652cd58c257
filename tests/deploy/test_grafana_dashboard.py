"""deploy/grafana/pd-transfer.json: a valid Grafana dashboard model over a Prometheus
datasource variable, with the panels operators need."""

from deploy_files import metric_names_in

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _exprs(panel):
    return [target["expr"] for target in panel.get("targets", [])]


def test_dashboard_model_basics(dashboard):
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["panels"], list) and dashboard["panels"]


def test_datasource_is_a_prometheus_variable_used_by_every_panel_and_query(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE
    for panel in _panels(dashboard):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"], panel["title"]


def test_panel_ids_are_unique_and_panels_do_not_overlap(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_query_ref_ids_are_unique_per_panel(dashboard):
    for panel in _panels(dashboard):
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_dashboard_covers_the_operators_questions(dashboard):
    used = metric_names_in(dashboard)
    assert {
        "pd_transfer_transfer_bytes_sum",  # throughput
        "pd_transfer_transfer_duration_seconds_bucket",  # latency quantiles
        "pd_transfer_transfer_failures_total",  # failures by reason
        "pd_transfer_rooms",  # rooms by state
        "pd_transfer_peers",  # peers by state
        "pd_transfer_peer_heartbeat_age_seconds",  # heartbeat age
        "pd_transfer_verdicts_total",  # verdicts by outcome/reason
        "pd_transfer_bad_frames_total",  # bad frames
        "pd_transfer_bootstrap_duration_seconds_bucket",  # bootstrap duration
    } <= used


def test_latency_panel_shows_p50_p90_p99(dashboard):
    exprs = [
        e
        for p in _panels(dashboard)
        for e in _exprs(p)
        if "pd_transfer_transfer_duration_seconds_bucket" in e
    ]
    quantiles = {e.split("histogram_quantile(", 1)[1].split(",", 1)[0] for e in exprs}
    assert {"0.5", "0.9", "0.99"} <= quantiles


def test_failures_are_broken_down_by_reason(dashboard):
    exprs = [e for p in _panels(dashboard) for e in _exprs(p) if "pd_transfer_transfer_failures_total" in e]
    assert any("by (role, reason)" in e for e in exprs)


def test_panels_over_counters_show_zero_rather_than_no_data(dashboard):
    # a counter series is absent until its first event on some sidecars (a failure reason,
    # say): the panel says 0 then, not "No data"; a ratio says there is nothing to divide
    for panel in _panels(dashboard):
        if any("_total" in expr for expr in _exprs(panel)):
            no_value = panel["fieldConfig"]["defaults"].get("noValue")
            assert no_value == ("no transfers" if panel["title"] == "Transfer success (1h)" else "0"), panel[
                "title"
            ]


def test_dashboard_shows_security_the_event_loop_doorbells_strategy_and_closed_connections(dashboard):
    assert {
        "pd_transfer_auth_failures_total",
        "pd_transfer_insecure",
        "pd_transfer_loop_stall_seconds_total",
        "pd_transfer_doorbells_total",
        "pd_transfer_strategy",
        "pd_transfer_connections_closed_total",
    } <= metric_names_in(dashboard)
