"""Past kwok: a real kubelet (built from the same Kubernetes module) over Debian's containerd and runc runs
the chart's ingress pod, as rendered, in a container of the MARS image imported from podman (no registry),
in a namespace enforcing Pod Security `restricted`. Its command is swapped for a self-check, since serving
would need Kafka and Postgres reachable from the pod network and a Service proxy, which this sandbox has
not (charts/README.md says how far it goes).

Needs the kubelet (`infra/k8s/build.sh --kubelet`), containerd, runc, the CNI plugins and the image
(`make image`): `make test-k8s-kubelet` provides them. Where one is missing the test skips and names it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import BASE
from mars_stack import helm, kube, kubelet
from mars_tools.deploy.identity_secrets import run_in_memory
from mars_tools.deploy.master_key_secret import secret_manifest
from test_chart_on_cluster import pod_from_template, restricted_namespace

pytestmark = pytest.mark.k8s

IMAGE = os.environ.get("MARS_IMAGE", "localhost/mars:latest")
NAMESPACE = "real"
RELEASE = "real"
#: Only pods that ask for the real node land there (kwok's nodes take the rest).
TAINT = {"key": "mars.local/real-node", "value": "true", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def real_node(cluster: kube.LocalCluster) -> Iterator[kubelet.RealNode]:
    needs = kubelet.missing()
    if needs:
        pytest.skip("a real kubelet needs " + ", ".join(needs) + ": `make test-k8s-kubelet` provides them")
    if not kubelet.podman_has(IMAGE):
        pytest.skip(f"the MARS image {IMAGE} is not in podman's store: `make image` builds it")
    node = kubelet.RealNode(cluster, images=(IMAGE,))
    node.start(kubelet.base_image(IMAGE))
    from kubernetes import client

    client.CoreV1Api(cluster.api_client()).patch_node(node.name, {"spec": {"taints": [TAINT]}})
    try:
        yield node
    finally:
        node.stop()


def test_the_chart_pod_runs_in_a_real_container_under_restricted(
    cluster: kube.LocalCluster, real_node: kubelet.RealNode
) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(cluster.api_client())
    restricted_namespace(cluster, NAMESPACE)
    objects = helm.render(BASE, release=RELEASE, namespace=NAMESPACE)
    # What the pod mounts, made for real: the release's ConfigMaps and Secrets, and the master key the
    # chart's hook would make.
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            core.create_namespaced_config_map(NAMESPACE, obj)
        elif obj["kind"] == "Secret":
            core.create_namespaced_secret(NAMESPACE, obj)
        elif obj["kind"] == "ServiceAccount":
            core.create_namespaced_service_account(NAMESPACE, obj)
    core.create_namespaced_secret(NAMESPACE, secret_manifest(f"{RELEASE}-mars-master-key", "master.key", {}))
    # The identity Secrets the chart's identity Job makes (CA bundle, the ingress's own identity).
    for made in run_in_memory(helm.job_args(objects, "identity")).values():
        core.create_namespaced_secret(NAMESPACE, made)
    # The ingress's own Kafka login, as Strimzi's User Operator makes it for its KafkaUser (key password).
    core.create_namespaced_secret(NAMESPACE, secret_manifest(f"{RELEASE}-mars-kafka-ingress", "password", {}))
    # Its own Postgres role's password (postgres.roles), as the operator creates it before installing.
    core.create_namespaced_secret(NAMESPACE, secret_manifest(f"{RELEASE}-mars-postgres-ingress", "password", {}))

    (ingress,) = [o for o in helm.find(objects, "Deployment") if o["metadata"]["name"].endswith("-ingress")]
    pod = pod_from_template(ingress)
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"
    spec["nodeSelector"] = {"kubernetes.io/hostname": real_node.name}
    spec["tolerations"] = [{**TAINT, "operator": "Equal"}]
    (container,) = spec["containers"]
    mounts = " ".join(m["mountPath"] for m in container["volumeMounts"])
    container.update(image=IMAGE, imagePullPolicy="Never")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        container.pop(probe, None)
    container["args"] = [
        "sh",
        "-c",
        "echo uid=$(id -u); touch /probe 2>/dev/null || echo root-read-only; touch /tmp/probe && echo tmp-writable; "
        f"for m in {mounts}; do test -e $m && echo mounted:$m; done; echo bootstrap=$MARS_KAFKA_BOOTSTRAP; "
        "python -c 'import mars_ingress; print(\"imports-ok\")'",
    ]
    core.create_namespaced_pod(NAMESPACE, pod)
    name = pod["metadata"]["name"]

    def finished() -> Any:
        found = core.read_namespaced_pod(name, NAMESPACE)
        return found if found.status.phase in ("Succeeded", "Failed") else None

    done = kube.wait_for(finished, 180, "the pod to finish in its container")
    log = core.read_namespaced_pod_log(name, NAMESPACE)  # through the API server and the kubelet
    assert done.status.phase == "Succeeded", log
    assert done.spec.node_name == real_node.name
    assert done.status.pod_ip and done.status.pod_ip.startswith("10.88."), done.status.pod_ip
    lines = set(log.split())
    assert {
        "uid=10001",
        "root-read-only",
        "tmp-writable",
        "imports-ok",
        "bootstrap=kafka-0.kafka:9092",
    } <= lines, log
    assert {f"mounted:{m['mountPath']}" for m in container["volumeMounts"]} <= lines, log
