"""The Grafana dashboard (charts/mars/dashboards/mars.json) and the ConfigMap that ships it to Grafana's
dashboard sidecar (templates/grafana-dashboard.yaml, `grafana.dashboard.*`). That each metric the
dashboard names is really served is checked over a live stack (tests/integration/test_metrics_live.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
from mars_stack import helm

BASE: dict[str, Any] = {"kafka": {"bootstrapServers": "kafka-0.kafka:9092"}, "postgres": {"host": "pg.db"}}
ENABLED: dict[str, Any] = {**BASE, "grafana": {"dashboard": {"enabled": True}}}
DASHBOARD_FILE = helm.CHART_DIR / "dashboards" / "mars.json"
#: What the dashboard must show, by the Prometheus series that show it (mars/metrics.py's instruments).
TOPICS: dict[str, set[str]] = {
    "turns by status and tenant": {"mars_turns_total"},
    "turn and stage latency": {
        "mars_turn_duration_milliseconds_bucket",
        "mars_stage_duration_milliseconds_bucket",
    },
    "Kafka consumer lag": {"mars_consumer_lag"},
    "cost per tenant and component": {"mars_cost_usd_USD_total"},
    "circuit breaker states": {"mars_circuit_state"},
    "QTM and judge outcomes": {"mars_qtm_outcomes_total", "mars_judge_outcomes_total"},
    "canary runs: reward, cost and arm shares per role, the test's statistic and boundary": {
        "mars_rollout_turns_total",
        "mars_rollout_reward",
        "mars_rollout_cost_usd_USD_total",
        "mars_rollout_statistic",
        "mars_rollout_boundary",
    },
}
FORBIDDEN_LABELS = {"user", "user_id", "session", "session_id", "turn", "turn_id"}
_METRIC = re.compile(r"\bmars_[A-Za-z0-9_]+\b")


def dashboard_configmaps(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in helm.find(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]


def rendered_dashboard(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dashboard ConfigMap `values` render, and its dashboard parsed."""
    (configmap,) = dashboard_configmaps(helm.render(values))
    return configmap, json.loads(configmap["data"]["mars.json"])


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return loaded


def test_no_dashboard_by_default() -> None:
    assert not dashboard_configmaps(helm.render(BASE))
    assert not dashboard_configmaps(helm.install_dry_run(BASE))


@pytest.mark.parametrize("kube", (helm.OLDEST_KUBE, helm.NEWEST_KUBE))
def test_enabled_renders_one_valid_configmap_for_the_sidecar(kube: str) -> None:
    assert helm.lint(ENABLED, kube_version=kube) == []
    (configmap,) = dashboard_configmaps(helm.render(ENABLED, kube_version=kube))
    kubernetes_validate.validate(configmap, kube, strict=True)
    assert configmap["metadata"]["name"] == "mars-dashboard"
    labels = configmap["metadata"]["labels"]
    assert labels["grafana_dashboard"] == "1"
    assert labels["app.kubernetes.io/instance"] == "mars" and labels["app.kubernetes.io/part-of"] == "mars"
    assert "annotations" not in configmap["metadata"]
    assert set(configmap["data"]) == {"mars.json"}
    assert json.loads(configmap["data"]["mars.json"]) == json.loads(DASHBOARD_FILE.read_text())
    assert dashboard_configmaps(helm.install_dry_run(ENABLED)) == [configmap]


def test_custom_labels_and_annotations_are_honoured() -> None:
    values = {
        **BASE,
        "fullnameOverride": "prod-mars",
        "grafana": {
            "dashboard": {
                "enabled": True,
                "labels": {"grafana_dashboard": "mars", "team": "routing"},
                "annotations": {"grafana_folder": "MARS"},
            }
        },
    }
    configmap, _ = rendered_dashboard(values)
    assert configmap["metadata"]["name"] == "prod-mars-dashboard"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "mars"
    assert configmap["metadata"]["labels"]["team"] == "routing"
    assert configmap["metadata"]["labels"]["app.kubernetes.io/name"] == "mars"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "MARS"}


@pytest.mark.parametrize(
    ("grafana", "message"),
    [
        ({"dashboard": {"enabled": "yes"}}, "/grafana/dashboard/enabled"),
        ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafana/dashboard/labels/grafana_dashboard"),
        ({"dashboard": {"folder": "MARS"}}, "additional properties 'folder' not allowed"),
        ({"datasource": "prom"}, "additional properties 'datasource' not allowed"),
    ],
)
def test_bad_grafana_values_are_refused(grafana: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.ChartError) as refused:
        helm.install_dry_run({**BASE, "grafana": grafana})
    assert message in str(refused.value)


def test_dashboard_has_a_datasource_and_a_tenant_variable(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    tenant = variables["tenant"]
    assert tenant["type"] == "query"
    assert tenant["datasource"]["uid"] == "${datasource}"
    query = tenant["query"]["query"] if isinstance(tenant["query"], dict) else tenant["query"]
    assert re.fullmatch(r"label_values\(\s*mars_turns_total\s*,\s*tenant\s*\)", query), query


def test_every_panel_queries_prometheus(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert len(panels) >= 6
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat", "state-timeline"}, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["gridPos"]["w"] > 0 and panel["gridPos"]["h"] > 0, panel["title"]
        targets = [t for t in panel.get("targets", []) if t.get("expr", "").strip()]
        assert targets, f"{panel['title']} has no PromQL target"
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in targets:
            assert _METRIC.search(target["expr"]), (panel["title"], target["expr"])


def test_dashboard_covers_each_topic(dashboard: dict[str, Any]) -> None:
    named = {m for e in exprs(dashboard) for m in _METRIC.findall(e)}
    for topic, metrics in TOPICS.items():
        assert metrics <= named, f"{topic}: {sorted(metrics - named)} not on the dashboard"
    everything = " ".join(exprs(dashboard))
    for label in ("status", "tenant", "group", "component", "arm", "outcome"):
        assert re.search(rf"by \([^)]*\b{label}\b", everything), f"nothing is broken down by {label}"
    # Latency panels are quantiles over histogram buckets.
    quantiles = re.findall(r"histogram_quantile\([^,]+,.*?(mars_\w+)", everything)
    assert quantiles and all(m.endswith("_bucket") for m in quantiles), quantiles


def test_no_per_user_label_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    text = json.dumps(dashboard)
    promql = " ".join(exprs(dashboard))
    used = set(re.findall(r'\b(\w+)\s*(?:=~|!~|!=|=)\s*"', promql))
    for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", promql):
        used |= set(re.findall(r"\w+", clause))
    used |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text))
    assert used and not used & FORBIDDEN_LABELS, sorted(used)


def test_the_canary_panels_name_the_series_the_router_serves(
    dashboard: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout series on the dashboard are exactly those mars.metrics serves (through the Prometheus
    exporter the services use), broken down by tenant and role, never by user."""
    from mars import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import CollectorRegistry, generate_latest

    monkeypatch.setattr(metrics, "_current", metrics.instruments())
    registry = CollectorRegistry()
    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.bind(provider)
    try:
        metrics.record_rollout_turn("t", "canary", "arm-a", -0.25, 0.001)
        metrics.record_rollout_test("t", 1.5, 4.0)
        registry.register(reader._collector)
        served = set(re.findall(r"^(mars_rollout_\w+?)(?:\{| )", generate_latest(registry).decode(), re.M))
    finally:
        provider.shutdown()
    named = {m for e in exprs(dashboard) for m in _METRIC.findall(e) if m.startswith("mars_rollout_")}
    assert named == served, (sorted(named), sorted(served))
    canary = [e for e in exprs(dashboard) if "mars_rollout_" in e]
    assert all(re.search(r"by \([^)]*\btenant\b", e) for e in canary), canary
    assert any(re.search(r"by \([^)]*\brole\b", e) for e in canary)
