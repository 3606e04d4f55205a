"""The chart against a real Kubernetes v1.37 API server (infra/k8s: etcd, kube-apiserver, the controller
manager and the scheduler built from the Go modules, kwok for the nodes), through Helm v4 as a library.

Admission (strict field validation, Pod Security `restricted`, RuntimeClass, ServiceAccounts), controllers
(Deployments to pods, hook Jobs, PV binding), scheduling (vLLM onto the GPU node only), and Helm's
install, upgrade, rollback and uninstall against live objects; then our own `mars deploy` tools. The tests
share one cluster and run alone, in any order: each that needs the release asks the `release` fixture, which
installs it where it is missing, and the GPU node is there only for the test that adds it.

Jobs: kwok marks the pods it plays Succeeded without running anything, so a Job's completion is asserted only
for the master-key hook, whose pods MasterKeyKubelet really runs (as the hook's service account).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import BASE, RESTRICTED
from crd_schemas import CRD_SCHEMAS
from mars_stack import helm, kube
from master_key_kubelet import MasterKeyKubelet

pytestmark = pytest.mark.k8s

NAMESPACE = "mars"
RELEASE = "mars"
HELM_TIMEOUT_S = 180


# --- helpers ---------------------------------------------------------------------------------------------


def _apis(cluster: kube.LocalCluster) -> Any:
    from kubernetes import client

    api = cluster.api_client()
    return (
        client.CoreV1Api(api),
        client.AppsV1Api(api),
        client.BatchV1Api(api),
    )


def restricted_namespace(cluster: kube.LocalCluster, name: str) -> None:
    core, _, _ = _apis(cluster)
    core.create_namespace({"metadata": {"name": name, "labels": RESTRICTED}})
    # Pods without a service account of their own use "default", which the controller manager makes.
    kube.wait_for(lambda: core.read_namespaced_service_account("default", name), 30, f"{name}/default")


def helm_config(cluster: kube.LocalCluster, namespace: str) -> Any:
    import helm_python

    return helm_python.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=namespace)


def dry_run_create(cluster: kube.LocalCluster, obj: dict[str, Any], namespace: str) -> str | None:
    """Server-side dry-run create with strict field validation: None when admitted, else the refusal."""
    from kubernetes import dynamic
    from kubernetes.client import ApiException

    resources = dynamic.DynamicClient(cluster.api_client()).resources
    resource = resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    try:
        resource.create(
            body=obj,
            namespace=namespace if resource.namespaced else None,
            dry_run="All",
            query_params=[("fieldValidation", "Strict")],
        )
    except ApiException as exc:
        return f"{obj['kind']}/{obj['metadata']['name']}: {exc.status} {exc.body}"
    return None


def pod_from_template(owner: dict[str, Any]) -> dict[str, Any]:
    template = owner["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{owner['metadata']['name']}-template".lower()[:63],
            "labels": template["metadata"].get("labels", {}),
        },
        "spec": template["spec"],
    }


def deployments(cluster: kube.LocalCluster, namespace: str) -> dict[str, Any]:
    _, apps, _ = _apis(cluster)
    return {
        d.metadata.labels["app.kubernetes.io/component"]: d
        for d in apps.list_namespaced_deployment(namespace).items
    }


def available(deployment: Any) -> bool:
    conditions = {c.type: c.status for c in deployment.status.conditions or []}
    return conditions.get("Available") == "True" and (deployment.status.ready_replicas or 0) >= (
        deployment.spec.replicas or 0
    )


def component_pods(cluster: kube.LocalCluster, namespace: str, component: str) -> list[Any]:
    core, _, _ = _apis(cluster)
    return list(
        core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/component={component}").items
    )


def mars_cli(cluster: kube.LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return cluster.run_mars(*args, timeout_s=120)


# --- admission -------------------------------------------------------------------------------------------


ADMISSION = "admission"


@pytest.fixture
def admission_namespace(cluster: kube.LocalCluster) -> str:
    """A restricted namespace holding the chart's ServiceAccounts (a Pod's admission looks its account up),
    made where it is missing."""
    if not _namespace_exists(cluster, ADMISSION):
        restricted_namespace(cluster, ADMISSION)
        core, _, _ = _apis(cluster)
        for account in helm.find(helm.render(BASE, release=RELEASE, namespace=ADMISSION), "ServiceAccount"):
            core.create_namespaced_service_account(ADMISSION, account)
    return ADMISSION


def test_every_default_object_and_pod_is_admitted_under_restricted(
    cluster: kube.LocalCluster, admission_namespace: str
) -> None:
    """Every object of the default values (hooks too) passes server-side dry-run with strict field
    validation, and every pod template passes Pod Security `restricted` as a Pod, with no RuntimeClass."""
    from kubernetes import client

    namespace = admission_namespace
    assert client.NodeV1Api(cluster.api_client()).list_runtime_class().items == []
    objects = helm.render(BASE, release=RELEASE, namespace=namespace)
    # Dry runs: the ServiceAccounts the fixture made are created again on paper only.
    refusals = [r for obj in objects if (r := dry_run_create(cluster, obj, namespace))]
    assert [r for r in refusals if "AlreadyExists" not in r] == []
    pods = [pod_from_template(o) for o in objects if o["kind"] in ("Deployment", "Job")]
    # Six services, the gateway, vLLM, and the migrate, topics, master-key and identity hooks.
    assert len(pods) == 12
    refusals = [r for pod in pods if (r := dry_run_create(cluster, pod, namespace))]
    assert refusals == []


def test_a_runtime_class_the_cluster_lacks_is_refused(cluster: kube.LocalCluster, admission_namespace: str) -> None:
    """Why the chart names none by default: the API refuses a pod whose RuntimeClass does not exist."""
    objects = helm.render(
        {**BASE, "vllm": {"runtimeClassName": "nvidia"}}, release=RELEASE, namespace=admission_namespace
    )
    (vllm,) = [o for o in helm.find(objects, "Deployment") if o["metadata"]["name"].endswith("-vllm")]
    refusal = dry_run_create(cluster, pod_from_template(vllm), admission_namespace)
    assert refusal is not None and 'RuntimeClass \\"nvidia\\" not found' in refusal


def test_a_privileged_pod_is_refused_by_pod_security(cluster: kube.LocalCluster, admission_namespace: str) -> None:
    """The namespace really enforces `restricted` (so the admissions above mean something)."""
    objects = helm.render(BASE, release=RELEASE, namespace=admission_namespace)
    pod = pod_from_template(helm.find(objects, "Deployment")[0])
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    refusal = dry_run_create(cluster, pod, admission_namespace)
    assert refusal is not None and "violates PodSecurity" in refusal


# --- the release's life ----------------------------------------------------------------------------------


def _installed(cluster: kube.LocalCluster, namespace: str, release: str) -> bool:
    config = helm_config(cluster, namespace)
    try:
        return any(r["name"] == release and r["status"] == "deployed" for r in config.list())
    except Exception:  # no such namespace yet, or no release in it
        return False
    finally:
        config.close()


def _namespace_exists(cluster: kube.LocalCluster, name: str) -> bool:
    core, _, _ = _apis(cluster)
    return any(n.metadata.name == name for n in core.list_namespace().items)


def _without_gpu_node(cluster: kube.LocalCluster) -> None:
    """Take the GPU node away (a test that added it gives it back), so vLLM has nowhere to go."""
    cluster.remove_node(kube.GPU_NODE.name)


@pytest.fixture
def gpu_node(cluster: kube.LocalCluster) -> Iterator[None]:
    """The GPU node, for this test only (the install test needs vLLM to find none)."""
    cluster.add_node(kube.GPU_NODE)
    try:
        cluster.wait_nodes_ready()
        yield
    finally:
        _without_gpu_node(cluster)


@pytest.fixture
def release(cluster: kube.LocalCluster) -> str:
    """The release RELEASE in NAMESPACE, installed where it is missing (an earlier test may have uninstalled
    it, or none installed it yet)."""
    if not _namespace_exists(cluster, NAMESPACE):
        restricted_namespace(cluster, NAMESPACE)
    if not _installed(cluster, NAMESPACE, RELEASE):
        config = helm_config(cluster, NAMESPACE)
        try:
            config.install(str(helm.CHART_DIR), RELEASE, BASE, namespace=NAMESPACE, timeout=HELM_TIMEOUT_S)
        finally:
            config.close()
    return RELEASE


def test_install_without_a_gpu_node_leaves_vllm_pending_and_status_says_why(
    cluster: kube.LocalCluster, master_keys: MasterKeyKubelet
) -> None:
    _without_gpu_node(cluster)
    namespace, name = "mars-install", RELEASE  # named as the chart: its objects are "mars-..."
    restricted_namespace(cluster, namespace)
    config = helm_config(cluster, namespace)
    try:
        # No --wait: vLLM cannot start without a GPU node. Hooks are waited on all the same.
        installed = config.install(str(helm.CHART_DIR), name, BASE, namespace=namespace, timeout=HELM_TIMEOUT_S)
    finally:
        config.close()
    assert installed["status"] == "deployed"
    # The pre-install hook ran for real, as the hook's own service account, and made the master key.
    assert [created for ns, _, created in master_keys.ran if ns == namespace] == [True]
    core, _, _ = _apis(cluster)
    assert core.read_namespaced_secret(f"{name}-master-key", namespace).data
    # Its Job completed on what its pod really did (Helm deleted the Job after success; its events remain).
    completed = {
        e.involved_object.name
        for e in core.list_namespaced_event(namespace).items
        if e.involved_object.kind == "Job" and e.reason == "Completed"
    }
    assert f"{name}-master-key" in completed

    def others_available() -> bool:
        found = deployments(cluster, namespace)
        return all(available(d) for c, d in found.items() if c != "vllm") and len(found) >= 7

    kube.wait_for(others_available, 120, "every Deployment but vLLM Available")
    kube.wait_for(lambda: len(component_pods(cluster, namespace, "vllm")) == 1, 30, "one vLLM pod")

    def unschedulable() -> str:
        (pod,) = component_pods(cluster, namespace, "vllm")
        scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        return scheduled.message if scheduled and scheduled.reason == "Unschedulable" else ""

    message = kube.wait_for(unschedulable, 60, "the scheduler's verdict on vLLM")
    assert "Insufficient nvidia.com/gpu" in message
    status = mars_cli(cluster, "deploy", "status", "--release", name, "-n", namespace, "--no-lag")
    assert status.returncode == 3, status.stdout + status.stderr  # not ready
    assert "Insufficient nvidia.com/gpu" in status.stdout
    assert "Pending" in status.stdout
    config = helm_config(cluster, namespace)
    try:  # its pods leave the nodes to the other tests' releases
        config.uninstall(name, timeout=HELM_TIMEOUT_S)
    finally:
        config.close()


def test_vllm_lands_on_the_gpu_node_and_nothing_else_does(
    cluster: kube.LocalCluster, release: str, gpu_node: None
) -> None:
    kube.wait_for(lambda: available(deployments(cluster, NAMESPACE)["vllm"]), 120, "vLLM Available")
    core, _, _ = _apis(cluster)
    placed = {p.metadata.name: p.spec.node_name for p in core.list_pod_for_all_namespaces().items}
    on_gpu = {name for name, node in placed.items() if node == kube.GPU_NODE.name}
    assert on_gpu and all(name.startswith(f"{release}-vllm-") for name in on_gpu), placed
    # The weights claim was bound by the PV controller.
    claim = core.read_namespaced_persistent_volume_claim(f"{release}-vllm-cache", NAMESPACE)
    assert claim.status.phase == "Bound"
    status = mars_cli(cluster, "deploy", "status", "--release", release, "-n", NAMESPACE, "--no-lag")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"{release}-vllm" in status.stdout


def test_upgrade_rolls_the_deployments_and_rollback_restores_them(
    cluster: kube.LocalCluster, master_keys: MasterKeyKubelet, release: str
) -> None:
    before = {
        c: d.spec.template.metadata.annotations or {} for c, d in deployments(cluster, NAMESPACE).items()
    }
    replicas_before = deployments(cluster, NAMESPACE)["ingress"].spec.replicas
    changed = {
        **BASE,
        "services": {"ingress": {"replicas": 3}, "router": {"podAnnotations": {"example.com/revision": "2"}}},
    }
    config = helm_config(cluster, NAMESPACE)
    try:
        revision = config.history(release)[-1]["revision"]
        # Not waited on (vLLM may have no GPU node); each Deployment's rollout is waited on below.
        upgraded = config.upgrade(str(helm.CHART_DIR), release, changed, namespace=NAMESPACE, timeout=HELM_TIMEOUT_S)
        assert upgraded["status"] == "deployed"

        def rolled() -> bool:
            now = deployments(cluster, NAMESPACE)
            router = now["router"]
            return (
                now["ingress"].spec.replicas == 3
                and available(now["ingress"])
                and available(router)
                and (router.status.updated_replicas or 0) == router.spec.replicas
                and router.status.observed_generation == router.metadata.generation
            )

        kube.wait_for(rolled, HELM_TIMEOUT_S, "the upgrade rolled out")
        now = deployments(cluster, NAMESPACE)
        assert now["router"].spec.template.metadata.annotations["example.com/revision"] == "2"
        # The pre-upgrade hook ran again and found the key it made (never replaced).
        assert master_keys.ran[-1][0] == NAMESPACE and master_keys.ran[-1][2] is False

        config.rollback(release, version=revision, timeout=HELM_TIMEOUT_S)
        history = config.history(release)
    finally:
        config.close()
    restored = deployments(cluster, NAMESPACE)
    assert restored["ingress"].spec.replicas == replicas_before == 2
    assert "example.com/revision" not in (restored["router"].spec.template.metadata.annotations or {})
    assert {c: d.spec.template.metadata.annotations or {} for c, d in restored.items()} == before
    kube.wait_for(
        lambda: all(available(d) for c, d in deployments(cluster, NAMESPACE).items() if c != "vllm"),
        120,
        "rolled back",
    )
    assert [(r["revision"], r["status"]) for r in history][-1] == (revision + 2, "deployed")


def test_replay_job_apply_is_admitted_under_restricted(cluster: kube.LocalCluster, release: str) -> None:
    """`mars deploy replay-job --apply` makes a Job whose pod the API admits under Pod Security `restricted`
    and the scheduler places. (Its completion would be kwok's, not the replay's: not asserted.)"""
    job_name = "mars-replay-test"
    _, _, batch = _apis(cluster)
    from kubernetes.client import ApiException, V1DeleteOptions

    try:  # a run before this one in the same cluster left it
        batch.delete_namespaced_job(job_name, NAMESPACE, body=V1DeleteOptions(propagation_policy="Foreground"))
        kube.wait_for(lambda: not _job_exists(batch, job_name), 60, "the earlier replay Job gone")
    except ApiException as exc:
        if exc.status != 404:
            raise
    created = mars_cli(
        cluster,
        "deploy",
        "replay-job",
        "--apply",
        "--release",
        release,
        "-n",
        NAMESPACE,
        "--image",
        "localhost/mars:test",
        "--name",
        job_name,
        "--",
        "read",
    )
    assert created.returncode == 0, created.stdout + created.stderr
    assert f"job.batch/{job_name} created" in created.stdout
    core, _, _ = _apis(cluster)

    def scheduled_pod() -> Any:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=f"job-name={job_name}").items
        return next((p for p in pods if p.spec.node_name), None)

    pod = kube.wait_for(scheduled_pod, 60, "the replay Job's pod admitted and scheduled")
    assert pod.spec.security_context.run_as_non_root is True


def _job_exists(batch: Any, name: str) -> bool:
    from kubernetes.client import ApiException

    try:
        batch.read_namespaced_job(name, NAMESPACE)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_uninstall_keeps_the_weights_claim_and_the_master_key(cluster: kube.LocalCluster, release: str) -> None:
    config = helm_config(cluster, NAMESPACE)
    try:
        config.uninstall(release, wait="watcher", timeout=HELM_TIMEOUT_S)
    finally:
        config.close()
    core, apps, _ = _apis(cluster)
    assert apps.list_namespaced_deployment(NAMESPACE).items == []
    claim = core.read_namespaced_persistent_volume_claim(f"{release}-vllm-cache", NAMESPACE)
    assert claim.status.phase in ("Bound", "Pending")  # Bound once vLLM ran on a GPU node; kept either way
    assert core.read_namespaced_secret(f"{release}-master-key", NAMESPACE).data


# --- profiles --------------------------------------------------------------------------------------------


def test_secure_profile_with_mutual_tls_network_policies_and_the_gateway(
    cluster: kube.LocalCluster, gpu_node: None
) -> None:
    namespace = "mars-secure"
    restricted_namespace(cluster, namespace)
    values = {
        **BASE,
        "tls": {"enabled": True, "secretName": "mars-tls", "mutual": True},
        "networkPolicy": {"enabled": True, "restrictEgress": True},
        "gateway": {"enabled": True},
        "vllm": {"cache": {"type": "emptyDir"}},
    }
    config = helm_config(cluster, namespace)
    try:
        release = config.install(
            str(helm.CHART_DIR), "secure", values, namespace=namespace, wait="watcher", timeout=HELM_TIMEOUT_S
        )
    finally:
        config.close()
    assert release["status"] == "deployed"
    found = deployments(cluster, namespace)
    assert "gateway" in found and all(available(d) for d in found.values())
    from kubernetes import client

    policies = client.NetworkingV1Api(cluster.api_client()).list_namespaced_network_policy(namespace).items
    assert len(policies) >= 6
    config = helm_config(cluster, namespace)
    try:  # its vLLM would wait for the next GPU node and take it from the next test's
        config.uninstall("secure", wait="watcher", timeout=HELM_TIMEOUT_S)
    finally:
        config.close()


def _crd(group: str, version: str, kind: str, plural: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": structural(schema)},
                }
            ],
        },
    }


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """One of tests/chart's JSON schemas as a CRD's structural schema: `const` becomes a one-value enum,
    `additionalProperties: false` goes (the API prunes, and strict field validation refuses, unknown
    fields), metadata is left to the API server, and a status may hold anything."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "const":
            out["enum"] = [value]
        elif key == "additionalProperties" and value is False:
            continue
        elif key == "properties":
            out["properties"] = {
                name: ({"type": "object"} if name == "metadata" else structural(sub))
                for name, sub in value.items()
            }
        elif isinstance(value, dict):
            out[key] = structural(value)
        else:
            out[key] = value
    if "type" not in out:  # a structural schema types every node
        if "properties" in out:
            out["type"] = "object"
        elif "items" in out:
            out["type"] = "array"
        elif "enum" in out:
            out["type"] = {str: "string", bool: "boolean", int: "integer"}.get(type(out["enum"][0]), "number")
    return out


def test_crd_parts_are_validated_by_the_api_server(cluster: kube.LocalCluster) -> None:
    """KEDA, ServiceMonitor and Strimzi topics, with their CRDs made from the schemas tests/chart holds:
    Helm sees the APIs (capabilities from discovery) and the API server validates each object."""
    from kubernetes import dynamic

    api = cluster.api_client()
    crds = dynamic.DynamicClient(api).resources.get(
        api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition"
    )
    plurals = {
        "KafkaTopic": "kafkatopics",
        "KafkaUser": "kafkausers",
        "ScaledObject": "scaledobjects",
        "TriggerAuthentication": "triggerauthentications",
        "ServiceMonitor": "servicemonitors",
    }
    for (api_version, kind), schema in CRD_SCHEMAS.items():
        group, version = api_version.split("/")
        crds.create(body=_crd(group, version, kind, plurals[kind], schema))

    def established() -> bool:
        items = crds.get().items
        return len(items) >= len(CRD_SCHEMAS) and all(
            any(c.type == "Established" and c.status == "True" for c in item.status.conditions)
            for item in items
        )

    kube.wait_for(established, 60, "the CRDs Established")
    namespace = "mars-crds"
    restricted_namespace(cluster, namespace)
    values = {
        **BASE,
        "autoscaling": {"mode": "keda"},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "kafka": {**BASE["kafka"], "strimzi": {"cluster": "kafka"}},
        "vllm": {"enabled": False},
        "state": {"qtmBackend": "rules"},
    }
    config = helm_config(cluster, namespace)
    try:
        config.install(str(helm.CHART_DIR), "crds", values, namespace=namespace, timeout=HELM_TIMEOUT_S)
    finally:
        config.close()
    dyn = dynamic.DynamicClient(api)
    counts = {
        kind: len(dyn.resources.get(api_version=api_version, kind=kind).get(namespace=namespace).items)
        for api_version, kind in CRD_SCHEMAS
    }
    assert counts["ScaledObject"] >= 5 and counts["ServiceMonitor"] >= 1 and counts["KafkaTopic"] >= 5, counts
    assert counts["KafkaUser"] == 7, counts  # each service and the tools' operator, with their ACLs
    # The API server checks these kinds for real: a wrong type or an unknown field is refused.
    topic = dyn.resources.get(api_version="kafka.strimzi.io/v1beta2", kind="KafkaTopic").get(
        namespace=namespace
    )
    sample = topic.items[0].to_dict()
    for name, spec in (
        ("typo-partitions", {**sample["spec"], "partitions": "six"}),
        ("typo-field", {**sample["spec"], "partiton": 6}),
    ):
        bad = {**sample, "metadata": {"name": name, "labels": sample["metadata"]["labels"]}, "spec": spec}
        refusal = dry_run_create(cluster, bad, namespace)
        assert refusal is not None and ("Invalid value" in refusal or "unknown field" in refusal), (
            name,
            refusal,
        )
