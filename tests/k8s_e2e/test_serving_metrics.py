"""Metrics for real: a Prometheus server built from its Go module scrapes the release's pods through
Kubernetes service discovery (the chart's ServiceMonitor selection), and every query of the shipped Grafana
dashboard returns data after the session's turns (test_serving.py and test_serving_faults.py run first)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import COMPONENTS, REPORT
from mars_stack import kube
from mars_stack.prometheus import dashboard_queries

pytestmark = pytest.mark.k8s_e2e


def test_every_pod_is_a_healthy_scrape_target(prometheus: Any) -> None:
    def all_up() -> list[dict[str, Any]]:
        targets = prometheus.targets()
        up = [t for t in targets if t["health"] == "up"]
        return up if len(up) == len(targets) == 2 * len(COMPONENTS) else []

    up = kube.wait_for(all_up, 90, "every pod's metrics endpoint scraped")
    assert {t["labels"]["component"] for t in up} == set(COMPONENTS)
    REPORT.append(f"Prometheus scrape targets up: {len(up)} (kubernetes_sd, role endpoints)")


def test_every_dashboard_query_returns_data(prometheus: Any) -> None:
    queries = dashboard_queries(rate_interval="5m", range_="30m")
    assert len(queries) >= 15
    empty: list[str] = []

    def answered() -> bool:
        empty.clear()
        empty.extend(f"{title}: {expr}" for title, expr in queries if not prometheus.query(expr))
        return not empty

    try:
        kube.wait_for(answered, 60, "every dashboard query to return a series")
    finally:
        REPORT.append(f"dashboard queries with data: {len(queries) - len(empty)} of {len(queries)}")
    assert not empty, empty
