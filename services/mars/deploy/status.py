"""`mars deploy status`: a release's workloads (ready of desired replicas) and its stage groups' lag.

`list_workloads` is the only part that talks to the API server (two list calls on an `AppsV1Api`); the
rows, the tables and the JSON are pure, and tested with a stand-in API object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from rich.table import Table

from mars.deploy.lag import TopicLag

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
) -> dict[str, Any]:
    """The status as plain data (`--output json`)."""
    return {
        "namespace": namespace,
        "release": release,
        "ready": all_ready(workloads),
        "workloads": [{**asdict(w), "is_ready": w.is_ready} for w in workloads],
        "lag": [asdict(row) for row in lags] if lags is not None else None,
        "lag_error": lag_error,
    }


def all_ready(workloads: Sequence[Workload]) -> bool:
    """Every workload has its desired replicas ready and up to date (and there is at least one)."""
    return bool(workloads) and all(w.is_ready for w in workloads)
