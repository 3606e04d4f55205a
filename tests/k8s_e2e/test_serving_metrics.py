"""Metrics for real: a Prometheus server built from its Go module scrapes the release's pods through
Kubernetes service discovery (the chart's ServiceMonitor selection), and every query of the shipped Grafana
dashboard returns data after the session's turns (test_serving.py and test_serving_faults.py run first), and
after a few turns of a canary run for the canary panels' series (mars.rollout.*)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from conftest import COMPONENTS, INGRESS_OPTIONS, REPORT, TENANT, service_address
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import kube, serving_cluster
from mars_stack.canary import rollout_turns, start_canary_run
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


#: Turns of the canary run: enough for every canary panel's series (and two scrapes of its counters), far
#: too few for the run's test to decide (the default warm-up), so routing stays as it was.
CANARY_TURNS = 6


def test_every_dashboard_query_returns_data(
    serving: serving_cluster.ServingCluster, api_key: str, prometheus: Any
) -> None:
    arms = [arm["name"] for arm in serving.chart_values()["modelPool"]]
    start_canary_run(serving.postgres_dsn, TENANT, arms)
    stub = svc_grpc.IngressStub(
        ingress_channel(service_address(serving, "ingress"), api_key, INGRESS_OPTIONS)
    )
    user = f"canary-{uuid.uuid4().hex[:8]}"
    for i in range(CANARY_TURNS):
        request = svc.TurnRequest(
            tenant=TENANT, user_id=user, session_id=f"c{i}", text=f"Plan day {i + 1} in Porto."
        )
        assert stub.SendTurn(request, timeout=120).text
    kube.wait_for(
        lambda: rollout_turns(serving.postgres_dsn, TENANT) >= CANARY_TURNS,
        60,
        "the canary run's judged turns",
    )
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
