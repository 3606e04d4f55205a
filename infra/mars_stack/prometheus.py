"""A Prometheus server (built from its Go module: `infra/k8s/build.sh --e2e`) that scrapes a release's pods
through Kubernetes service discovery, selecting exactly what the chart's ServiceMonitor selects: the
endpoints of the release's Services labelled app.kubernetes.io/name=mars with a MARS component, on their
`metrics` port. It runs on the node's machine and reaches the pods on the pod network.

`query()` runs an instant PromQL query over the HTTP API; `dashboard_queries()` reads the shipped Grafana
dashboard's expressions with its variables given concrete values, as Grafana would send them.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from mars import topology

from mars_stack.helm import CHART_DIR
from mars_stack.kube import LocalCluster
from mars_stack.kube_control_plane import BIN_DIR, ClusterError, stop_processes, wait_for
from mars_stack.readiness import free_port

DASHBOARD = CHART_DIR / "dashboards" / "mars.json"


def components() -> tuple[str, ...]:
    """The chart's components that serve metrics: every deployable (mars.topology)."""
    return (*topology.NAMES, topology.GATEWAY.name)


def built() -> bool:
    return (BIN_DIR / "prometheus").is_file()


def scrape_config(cluster: LocalCluster, namespace: str, release: str, interval_s: int) -> dict[str, Any]:
    """The ServiceMonitor's selection as a kubernetes_sd scrape job (role endpoints)."""
    keep = [
        ("__meta_kubernetes_service_label_app_kubernetes_io_name", "mars"),
        ("__meta_kubernetes_service_label_app_kubernetes_io_instance", release),
        ("__meta_kubernetes_service_label_app_kubernetes_io_component", "|".join(components())),
        ("__meta_kubernetes_endpoint_port_name", "metrics"),
    ]
    return {
        "global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
        "scrape_configs": [
            {
                "job_name": f"{namespace}/{release}",
                "metrics_path": "/metrics",
                "kubernetes_sd_configs": [
                    {
                        "role": "endpoints",
                        "kubeconfig_file": str(cluster.kubeconfig),
                        "namespaces": {"names": [namespace]},
                    }
                ],
                "relabel_configs": [
                    *({"source_labels": [label], "regex": value, "action": "keep"} for label, value in keep),
                    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {
                        "source_labels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
                        "target_label": "component",
                    },
                ],
            }
        ],
    }


class LocalPrometheus:
    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        release: str,
        interval_s: int = 5,
        workdir: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir or cluster.workdir / "prometheus"
        self.config = scrape_config(cluster, namespace, release, interval_s)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalPrometheus:
        if not built():
            raise ClusterError("no Prometheus binary: infra/k8s/build.sh --e2e builds it")
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(self.config))
        self.port = free_port()
        log = self.cluster.logdir / "prometheus.log"
        with log.open("ab") as out:
            self._proc = subprocess.Popen(
                [
                    str(BIN_DIR / "prometheus"),
                    f"--config.file={path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self._proc
        import httpx

        def ready() -> bool:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

        wait_for(ready, 60, "Prometheus ready", proc, log)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            stop_processes([self._proc])
            self._proc = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _get(self, path: str, **params: str) -> Any:
        import httpx

        reply = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        body = reply.json()
        if body.get("status") != "success":
            raise ClusterError(f"Prometheus {path}: {body.get('error', reply.text[:300])}")
        return body["data"]

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets with their health ("up", "down", "unknown")."""
        return list(self._get("/api/v1/targets", state="active")["activeTargets"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (empty: no series)."""
        data = self._get("/api/v1/query", query=expr)
        return list(data["result"]) if data["resultType"] == "vector" else [data["result"]]


def dashboard_queries(
    dashboard: Path = DASHBOARD, rate_interval: str = "1m", range_: str = "15m"
) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, with Grafana's variables replaced: $tenant by a match of
    any tenant, $__rate_interval and $__range by the given durations."""
    doc = json.loads(dashboard.read_text())
    out = []
    for panel in doc.get("panels", []):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if not expr:
                continue
            expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
            expr = re.sub(r'=~"\$tenant"', '=~".*"', expr)
            out.append((str(panel.get("title", "")), expr))
    return out
