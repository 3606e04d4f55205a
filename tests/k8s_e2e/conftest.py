"""The chart serving on a real node (mars_stack.serving_cluster): one cluster and one release for the whole
session, installed by the first test that asks for it (`release`).

Needs root, the control plane, the kubelet, kube-proxy and CoreDNS (`infra/k8s/build.sh --e2e`),
containerd, runc, the CNI plugins, iptables and the MARS image (`make image`): `make test-k8s-e2e` provides
them. Where one is missing every test here skips and names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mars import topology
from mars_stack import helm, kube, kubelet, serving_cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

IMAGE = os.environ.get("MARS_IMAGE", "localhost/mars:latest")
NAMESPACE = "mars"
RELEASE = "mars"
TENANT = "k8s"
HELM_TIMEOUT_S = 900
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
COMPONENTS = (*topology.NAMES, topology.GATEWAY.name)
#: The run's figures (install time, turns answered, the fault runs' counts), printed at its end.
REPORT: list[str] = []
#: The ingress serves TLS (the chart's default, minted by its identity Job): reached by its ClusterIP, a
#: client checks the certificate against the Service's name. `api_key` sets MARS_TLS_CA_FILE.
INGRESS_OPTIONS = (("grpc.ssl_target_name_override", f"{RELEASE}-ingress"),)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REPORT:
        terminalreporter.section("MARS on a real node: figures")
        for line in REPORT:
            terminalreporter.write_line(line)


# --- the cluster and the release -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def serving() -> Iterator[serving_cluster.ServingCluster]:
    if os.geteuid() != 0:
        pytest.skip("a real node needs root (network links, iptables, containerd)")
    needs = serving_cluster.missing()
    if needs:
        pytest.skip("the serving cluster needs " + ", ".join(needs) + ": `make test-k8s-e2e` provides them")
    if not kubelet.podman_has(IMAGE):
        pytest.skip(f"the MARS image {IMAGE} is not in podman's store: `make image` builds it")
    cluster = serving_cluster.ServingCluster(IMAGE, kubelet.base_image(IMAGE))
    started = time.monotonic()
    cluster.start(lambda message: print(f"[serving cluster] {message}", flush=True))
    REPORT.append(
        f"cluster, node, Kafka, Postgres and the image on the node: {time.monotonic() - started:.0f} s"
    )
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def release(serving: serving_cluster.ServingCluster) -> float:
    """`helm install` of the chart, waited on until every pod is Ready: the seconds it took."""
    core(serving).create_namespace({"metadata": {"name": NAMESPACE, "labels": RESTRICTED}})
    kube.wait_for(
        lambda: core(serving).read_namespaced_service_account("default", NAMESPACE), 30, "default SA"
    )
    # Each service's Postgres role login (postgres.roles, the chart's default), as an operator makes them.
    for secret in serving.postgres_role_secrets(RELEASE):
        core(serving).create_namespaced_secret(NAMESPACE, secret)
    config = helm_config(serving)
    started = time.monotonic()
    try:
        installed = config.install(
            str(helm.CHART_DIR),
            RELEASE,
            serving.chart_values(),
            namespace=NAMESPACE,
            wait="watcher",
            timeout=HELM_TIMEOUT_S,
        )
        assert installed["status"] == "deployed"
        kube.wait_for(lambda: all_ready(serving), 300, "every pod Ready")
    except BaseException:
        print(diagnose(serving), flush=True)
        raise
    finally:
        config.close()
    seconds = time.monotonic() - started
    REPORT.append(f"helm install until every pod Ready: {seconds:.0f} s")
    return seconds


@pytest.fixture(scope="session")
def api_key(serving: serving_cluster.ServingCluster, release: float) -> str:
    import base64

    from mars.auth import mint_key

    # The ingress's TLS: trust the CA of the Secret the chart's identity Job made, as NOTES tells users to.
    secret = core(serving).read_namespaced_secret(f"{RELEASE}-tls", NAMESPACE)
    ca = serving.workdir / "ingress-ca.crt"
    ca.write_bytes(base64.b64decode(secret.data["ca.crt"]))
    os.environ["MARS_TLS_CA_FILE"] = str(ca)
    return mint_key(serving.postgres_dsn, TENANT, label="k8s e2e").key


# --- helpers ---------------------------------------------------------------------------------------------


def helm_config(serving: serving_cluster.ServingCluster) -> Any:
    import helm_python

    return helm_python.Config(kubeconfig_path=str(serving.cluster.kubeconfig), namespace=NAMESPACE)


def core(serving: serving_cluster.ServingCluster) -> Any:
    from kubernetes import client

    return client.CoreV1Api(serving.cluster.api_client())


def apps(serving: serving_cluster.ServingCluster) -> Any:
    from kubernetes import client

    return client.AppsV1Api(serving.cluster.api_client())


def service_address(serving: serving_cluster.ServingCluster, component: str) -> str:
    """The ClusterIP:port of the release's Service for `component` (reached through kube-proxy)."""
    found = core(serving).read_namespaced_service(f"{RELEASE}-{component}", NAMESPACE)
    return f"{found.spec.cluster_ip}:{found.spec.ports[0].port}"


def all_ready(serving: serving_cluster.ServingCluster) -> bool:
    """Every Deployment rolled out: all its replicas updated, Ready, and no old pod left."""
    found = apps(serving).list_namespaced_deployment(NAMESPACE).items
    return len(found) == len(COMPONENTS) and all(
        (d.status.ready_replicas or 0) == d.spec.replicas
        and (d.status.updated_replicas or 0) == d.spec.replicas
        and (d.status.replicas or 0) == d.spec.replicas
        and (d.status.observed_generation or 0) >= d.metadata.generation
        for d in found
    )


@pytest.fixture(scope="session")
def prometheus(serving: serving_cluster.ServingCluster, release: float) -> Iterator[Any]:
    """Prometheus scraping the release's pods through Kubernetes service discovery, from the install on
    (so it sees every turn the session sends)."""
    from mars_stack.prometheus import LocalPrometheus, built

    if not built():
        pytest.skip("no Prometheus binary: `infra/k8s/build.sh --e2e` builds it (make test-k8s-e2e)")
    with LocalPrometheus(serving.cluster, NAMESPACE, RELEASE) as server:
        yield server


def diagnose(serving: serving_cluster.ServingCluster) -> str:
    """What a failed install or rollout looks like: each pod's phase and readiness, the namespace's warning
    events, and the log tail (this run's and the previous container's) of every pod that is not Ready."""
    api = core(serving)
    out = []
    for pod in api.list_namespaced_pod(NAMESPACE).items:
        ready = {c.type: c.status for c in pod.status.conditions or []}.get("Ready")
        out.append(f"pod {pod.metadata.name}: {pod.status.phase}, Ready={ready}")
        if ready == "True":
            continue
        for previous in (False, True):
            try:
                log = api.read_namespaced_pod_log(
                    pod.metadata.name, NAMESPACE, previous=previous, tail_lines=40
                )
            except Exception as exc:  # no such container (yet): say so and go on
                log = f"({type(exc).__name__})"
            out.append(f"--- {'previous ' if previous else ''}log of {pod.metadata.name}:\n{log}")
    for event in api.list_namespaced_event(NAMESPACE).items:
        if event.type == "Warning":
            out.append(f"event {event.involved_object.kind}/{event.involved_object.name}: {event.message}")
    return "\n".join(out)


def mars_cli(serving: serving_cluster.ServingCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`mars ARGS` against the cluster."""
    return serving.cluster.run_mars(*args)
