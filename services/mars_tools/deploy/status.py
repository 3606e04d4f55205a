"""`mars deploy status`: a release's workloads (ready of desired replicas), why its pods that are not
running wait (the scheduler's verdict, a container's waiting reason), and its stage groups' lag.

`list_workloads` and `list_waiting_pods` are the only parts that talk to the API server (list calls on an
`AppsV1Api` and a `CoreV1Api`); the rows, the tables and the JSON are pure, and tested with stand-in API
objects (and against a real API server in tests/k8s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from rich.table import Table

from mars_tools.deploy.lag import TopicLag

#: Labels the chart puts on everything of a release (charts/mars/templates/_helpers.tpl, "mars.labels").
INSTANCE_LABEL = "app.kubernetes.io/instance"
PART_OF_LABEL = "app.kubernetes.io/part-of"
COMPONENT_LABEL = "app.kubernetes.io/component"


def release_selector(release: str) -> str:
    """The label selector of a release's objects."""
    return f"{INSTANCE_LABEL}={release},{PART_OF_LABEL}=mars"


class AppsApi(Protocol):
    """The two calls of kubernetes.client.AppsV1Api this module makes."""

    def list_namespaced_deployment(self, namespace: str, *, label_selector: str | None = ...) -> Any: ...

    def list_namespaced_stateful_set(self, namespace: str, *, label_selector: str | None = ...) -> Any: ...


class CoreApi(Protocol):
    """The call of kubernetes.client.CoreV1Api this module makes."""

    def list_namespaced_pod(self, namespace: str, *, label_selector: str | None = ...) -> Any: ...


@dataclass(frozen=True)
class WaitingPod:
    """A pod of the release that is not ready, and what it waits for."""

    name: str
    component: str
    phase: str
    reason: str
    message: str


def waiting_pod_from(pod: Any) -> WaitingPod | None:
    """The pod (kubernetes client model) as a row if it is not ready: the PodScheduled condition's reason
    and message while unscheduled (e.g. "0/2 nodes are available: 2 Insufficient nvidia.com/gpu"), else
    the first waiting or failed container's; None for a ready or finished pod."""
    status = pod.status
    if status is None:
        return None
    phase = status.phase or "Unknown"
    conditions = {c.type: c for c in status.conditions or []}
    ready = conditions.get("Ready")
    if phase in ("Succeeded",) or (ready is not None and ready.status == "True"):
        return None
    reason, message = "", ""
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.status != "True":
        reason, message = scheduled.reason or "", scheduled.message or ""
    else:
        for container in status.container_statuses or []:
            state = container.state
            waiting = state.waiting if state else None
            if waiting is not None:
                reason, message = waiting.reason or "", waiting.message or ""
                break
    labels = pod.metadata.labels or {}
    return WaitingPod(pod.metadata.name, labels.get(COMPONENT_LABEL, ""), phase, reason, message)


def list_waiting_pods(core: CoreApi, namespace: str, release: str) -> list[WaitingPod]:
    """The release's pods that are not ready, by name. Calls the API server."""
    pods = core.list_namespaced_pod(namespace, label_selector=release_selector(release)).items
    rows = [row for pod in pods if (row := waiting_pod_from(pod)) is not None]
    return sorted(rows, key=lambda row: row.name)


@dataclass(frozen=True)
class Workload:
    kind: str
    name: str
    component: str
    desired: int
    ready: int
    updated: int
    available: int

    @property
    def is_ready(self) -> bool:
        return self.ready >= self.desired and self.updated >= self.desired


def workload_from(kind: str, obj: Any) -> Workload:
    """A Deployment or StatefulSet (kubernetes client model) as a row. The API leaves counts that are zero
    unset (None); StatefulSets have no available count before Kubernetes 1.22."""
    status = obj.status
    labels = obj.metadata.labels or {}
    desired = obj.spec.replicas if obj.spec.replicas is not None else 1
    return Workload(
        kind=kind,
        name=obj.metadata.name,
        component=labels.get(COMPONENT_LABEL, ""),
        desired=desired,
        ready=(status.ready_replicas or 0) if status else 0,
        updated=(status.updated_replicas or 0) if status else 0,
        available=(getattr(status, "available_replicas", None) or 0) if status else 0,
    )


def list_workloads(apps: AppsApi, namespace: str, release: str) -> list[Workload]:
    """The release's Deployments and StatefulSets, by name. Calls the API server."""
    selector = release_selector(release)
    found = [
        workload_from("Deployment", d)
        for d in apps.list_namespaced_deployment(namespace, label_selector=selector).items
    ]
    found += [
        workload_from("StatefulSet", s)
        for s in apps.list_namespaced_stateful_set(namespace, label_selector=selector).items
    ]
    return sorted(found, key=lambda w: (w.name, w.kind))


def workload_table(workloads: Sequence[Workload]) -> Table:
    table = Table(title="workloads", title_justify="left")
    for col in ("kind", "name", "component", "ready", "up-to-date", "available"):
        table.add_column(col, justify="right" if col in ("ready", "up-to-date", "available") else "left")
    for w in workloads:
        ready = f"{w.ready}/{w.desired}"
        table.add_row(
            w.kind,
            w.name,
            w.component,
            ready if w.is_ready else f"[red]{ready}[/]",
            str(w.updated),
            str(w.available),
        )
    return table


def waiting_table(pods: Sequence[WaitingPod]) -> Table:
    table = Table(title="pods not ready", title_justify="left")
    for col in ("pod", "component", "phase", "reason", "message"):
        table.add_column(col, overflow="fold")
    for pod in pods:
        table.add_row(pod.name, pod.component, pod.phase, pod.reason, pod.message)
    return table


def lag_table(lags: Sequence[TopicLag]) -> Table:
    table = Table(title="consumer-group lag", title_justify="left")
    for col in ("group", "service", "topic", "partitions", "lag"):
        table.add_column(col, justify="right" if col in ("partitions", "lag") else "left")
    for row in lags:
        if row.lag is None:
            lag = "[red]no topic[/]"
        else:
            lag = f"{row.lag:,}"
            if row.uncommitted:
                lag += f" ({row.uncommitted} uncommitted)"
        table.add_row(row.group, row.service, row.topic, str(row.partitions), lag)
    return table


def status_json(
    namespace: str,
    release: str,
    workloads: Sequence[Workload],
    lags: Sequence[TopicLag] | None,
    lag_error: str | None = None,
    waiting: Sequence[WaitingPod] = (),
) -> dict[str, Any]:
    """The status as plain data (`--output json`)."""
    return {
        "namespace": namespace,
        "release": release,
        "ready": all_ready(workloads),
        "workloads": [{**asdict(w), "is_ready": w.is_ready} for w in workloads],
        "waiting_pods": [asdict(pod) for pod in waiting],
        "lag": [asdict(row) for row in lags] if lags is not None else None,
        "lag_error": lag_error,
    }


def all_ready(workloads: Sequence[Workload]) -> bool:
    """Every workload has its desired replicas ready and up to date (and there is at least one)."""
    return bool(workloads) and all(w.is_ready for w in workloads)
