"""`mars deploy status` without a cluster: workloads read from a stand-in AppsV1Api, lag arithmetic, and
the tables and JSON built from them."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from mars.topology import STAGE_GROUPS
from mars_tools.deploy.lag import TopicLag, topic_lag
from mars_tools.deploy.status import (
    all_ready,
    lag_table,
    list_waiting_pods,
    list_workloads,
    release_selector,
    status_json,
    waiting_table,
    workload_table,
)
from rich.console import Console


def workload(name: str, component: str, replicas: int | None, ready: int | None, updated: int | None) -> Any:
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels={"app.kubernetes.io/component": component}),
        spec=SimpleNamespace(replicas=replicas),
        status=SimpleNamespace(ready_replicas=ready, updated_replicas=updated, available_replicas=ready),
    )


class FakeApps:
    """The two AppsV1Api calls, answering with fixed lists and remembering what was asked."""

    def __init__(self, deployments: list[Any], statefulsets: list[Any]) -> None:
        self.deployments = deployments
        self.statefulsets = statefulsets
        self.calls: list[tuple[str, str, str | None]] = []

    def list_namespaced_deployment(self, namespace: str, *, label_selector: str | None = None) -> Any:
        self.calls.append(("deployments", namespace, label_selector))
        return SimpleNamespace(items=self.deployments)

    def list_namespaced_stateful_set(self, namespace: str, *, label_selector: str | None = None) -> Any:
        self.calls.append(("statefulsets", namespace, label_selector))
        return SimpleNamespace(items=self.statefulsets)


def render(table: Any) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_workloads_of_one_release_by_its_labels() -> None:
    apps = FakeApps(
        [
            workload("prod-mars-router", "router", 2, 2, 2),
            # The API leaves zero counts unset: a Deployment with nothing ready yet.
            workload("prod-mars-dispatch", "dispatch", 3, None, None),
        ],
        [workload("prod-mars-memory", "memory", 2, 1, 2)],
    )
    rows = list_workloads(apps, "ml", "prod")
    assert [c[:2] for c in apps.calls] == [("deployments", "ml"), ("statefulsets", "ml")]
    assert {c[2] for c in apps.calls} == {release_selector("prod")}
    assert release_selector("prod") == "app.kubernetes.io/instance=prod,app.kubernetes.io/part-of=mars"
    assert [(w.name, w.kind, w.ready, w.desired) for w in rows] == [
        ("prod-mars-dispatch", "Deployment", 0, 3),
        ("prod-mars-memory", "StatefulSet", 1, 2),
        ("prod-mars-router", "Deployment", 2, 2),
    ]
    assert [w.is_ready for w in rows] == [False, False, True]
    assert not all_ready(rows)
    text = render(workload_table(rows))
    assert "0/3" in text and "1/2" in text and "2/2" in text and "StatefulSet" in text


def test_ready_needs_every_replica_up_to_date_and_at_least_one_workload() -> None:
    rows = list_workloads(FakeApps([workload("a", "state", 2, 2, 1)], []), "ns", "r")
    assert not all_ready(rows)  # a rollout still going on
    assert all_ready(list_workloads(FakeApps([workload("a", "state", 2, 2, 2)], []), "ns", "r"))
    assert not all_ready([])  # nothing found: a wrong release or namespace is not "ready"


def test_lag_is_end_minus_committed_and_counts_uncommitted_partitions_from_the_start() -> None:
    lag = topic_lag(
        "run7.mars-state",
        "state",
        "run7.mars.turn.received",
        [0, 1, 2],
        committed={0: 10, 1: -1},  # 1: Kafka's "nothing committed"; 2: absent altogether
        beginning={0: 0, 1: 5, 2: 0},
        end={0: 15, 1: 8, 2: 4},
    )
    assert lag == TopicLag("run7.mars-state", "state", "run7.mars.turn.received", 5 + 3 + 4, 3, 2)


def test_lag_is_never_negative_and_a_missing_topic_says_so() -> None:
    ahead = topic_lag("g", "s", "t", [0], committed={0: 12}, beginning={0: 0}, end={0: 10})
    assert ahead.lag == 0
    missing = topic_lag("g", "s", "t", [], committed={}, beginning={}, end={})
    assert missing.lag is None and missing.partitions == 0


def test_lag_table_and_json() -> None:
    lags = [
        TopicLag("mars-router", "router", "mars.turn.view", 1234, 12, 0),
        TopicLag("mars-judge", "judge", "mars.turn.feedback", 7, 12, 3),
        TopicLag("mars-dispatch", "dispatch", "mars.turn.routed", None, 0, 0),
    ]
    text = render(lag_table(lags))
    assert "1,234" in text and "7 (3 uncommitted)" in text and "no topic" in text
    rows = list_workloads(FakeApps([workload("mars-router", "router", 1, 1, 1)], []), "ns", "mars")
    data = json.loads(json.dumps(status_json("ns", "mars", rows, lags)))
    assert data["ready"] is True
    assert data["workloads"][0]["name"] == "mars-router" and data["workloads"][0]["is_ready"] is True
    assert data["lag"][0] == {
        "group": "mars-router",
        "service": "router",
        "topic": "mars.turn.view",
        "lag": 1234,
        "partitions": 12,
        "uncommitted": 0,
    }
    assert status_json("ns", "mars", rows, None, "no broker")["lag_error"] == "no broker"


def test_status_covers_every_stage_group() -> None:
    names = [g.name for g in STAGE_GROUPS]
    assert len(names) == len(set(names))
    assert {"mars-state", "mars-memory-view", "mars-router", "mars-dispatch", "mars-judge"} <= set(names)


def test_without_the_kubernetes_client_status_says_how_to_install_it(monkeypatch: Any, capsys: Any) -> None:
    import sys

    import pytest
    from mars_tools.cli import main

    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if `pip install mars` without [deploy]
    with pytest.raises(SystemExit) as exited:
        main(["deploy", "status", "--no-lag"])
    assert exited.value.code == 2
    assert "pip install 'mars[deploy]'" in capsys.readouterr().out


def pod(name: str, phase: str, conditions: dict[str, tuple[str, str, str]], waiting: str = "") -> Any:
    state = SimpleNamespace(waiting=SimpleNamespace(reason=waiting, message="back-off") if waiting else None)
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels={"app.kubernetes.io/component": name.split("-")[1]}),
        status=SimpleNamespace(
            phase=phase,
            conditions=[
                SimpleNamespace(type=kind, status=status, reason=reason, message=message)
                for kind, (status, reason, message) in conditions.items()
            ],
            container_statuses=[SimpleNamespace(state=state)],
        ),
    )


class FakeCore:
    def __init__(self, pods: list[Any]) -> None:
        self.pods = pods
        self.selectors: list[str | None] = []

    def list_namespaced_pod(self, namespace: str, *, label_selector: str | None = None) -> Any:
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods)


def test_waiting_pods_say_what_they_wait_for() -> None:
    verdict = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    core = FakeCore(
        [
            pod("mars-vllm-1", "Pending", {"PodScheduled": ("False", "Unschedulable", verdict)}),
            pod("mars-ingress-1", "Running", {"PodScheduled": ("True", "", ""), "Ready": ("True", "", "")}),
            pod(
                "mars-router-1",
                "Running",
                {"PodScheduled": ("True", "", ""), "Ready": ("False", "ContainersNotReady", "")},
                waiting="CrashLoopBackOff",
            ),
            pod("mars-migrate-1", "Succeeded", {"Ready": ("False", "PodCompleted", "")}),
        ]
    )
    rows = list_waiting_pods(core, "mars", "mars")
    assert core.selectors == [release_selector("mars")]
    assert [(r.name, r.component, r.phase, r.reason) for r in rows] == [
        ("mars-router-1", "router", "Running", "CrashLoopBackOff"),
        ("mars-vllm-1", "vllm", "Pending", "Unschedulable"),
    ]
    assert rows[1].message == verdict
    text = render(waiting_table(rows))
    assert "Insufficient nvidia.com/gpu" in text and "CrashLoopBackOff" in text
    data = status_json("mars", "mars", [], None, waiting=rows)
    assert data["waiting_pods"][1]["reason"] == "Unschedulable"
