"""The Helm chart, rendered by real Helm (v4 as a library) and checked against Kubernetes' own schemas.

Each profile goes through `helm install --dry-run=client` (values schema, kubeVersion, YAML) and `helm lint
--strict`, then renders at the oldest and newest Kubernetes versions the chart supports; every object is
validated by kubernetes-validate --strict, and a kind without a schema fails unless it is an allow-listed
CRD checked by a schema of our own (crd_schemas.py). What no schema can say is asserted below: GPU
scheduling, probes, security contexts, who may reach whom and KEDA triggers per consumer group; that the
environment the chart hands each deployable is its settings under their current names is
test_chart_settings.py's.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from crd_schemas import CRD_SCHEMAS
from mars import topology
from mars.config import env_name
from mars.identity import SERVICE_IDENTITIES
from mars.model_pool import load_pool
from mars_stack import helm
from mars_tools import cli
from mars_tools.deploy.identity_secrets import run_in_memory

# The chart deploys the topology's services; the stages are those with internal gRPC callers (not the
# ingress, whose callers are tenants).
SERVICES = topology.NAMES
STAGES = tuple(s.name for s in topology.SERVICES if s.permissions)
BASE: dict[str, Any] = {"kafka": {"bootstrapServers": "kafka-0.kafka:9092"}, "postgres": {"host": "pg.db"}}


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        _merge(out, copy.deepcopy(part))
    return out


def _merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


SASL_TLS = {
    "kafka": {
        "securityProtocol": "SASL_SSL",
        # One shared login (the per-service logins of the default are tested on their own).
        "sasl": {
            "mechanism": "SCRAM-SHA-512",
            "perService": False,
            "username": "mars",
            "existingSecret": "kafka-user",
        },
        "tls": {"caSecret": "kafka-ca"},
    },
    "postgres": {"existingSecret": "pg-credentials", "sslMode": "verify-full"},
}
PROFILES: dict[str, dict[str, Any]] = {
    "default": BASE,
    "gpu": merged(BASE, {"services": {"memory": {"gpu": {"enabled": True}}}, "vllm": {"gpus": 2}}),
    "kafka-sasl-tls": merged(BASE, SASL_TLS),
    "keda": merged(
        BASE, SASL_TLS, {"autoscaling": {"mode": "keda", "maxReplicas": 40}, "kafka": {"partitions": 6}}
    ),
    "networkpolicy": merged(
        BASE,
        {
            "networkPolicy": {
                "restrictEgress": True,
                "ingressFrom": [{"podSelector": {"matchLabels": {"mars.io/client": "true"}}}],
                "gatewayFrom": [{"podSelector": {"matchLabels": {"mars.io/client": "true"}}}],
                "egressTo": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
            },
            "metrics": {"serviceMonitor": {"enabled": True}},
        },
    ),
    "tls-mutual": merged(BASE, {"tls": {"enabled": True, "secretName": "mars-tls", "mutual": True}}),
    "hpa-no-vllm": merged(
        BASE,
        {
            "autoscaling": {"mode": "hpa"},
            "vllm": {"enabled": False},
            "state": {"qtmBackend": "rules"},
            "modelPool": [
                {
                    "name": "gpt-4o-mini",
                    "base_url": "https://api.openai.com/v1",
                    "model": "gpt-4o-mini",
                    "api_key_env": "OPENAI_API_KEY",
                    "context_window": 128000,
                    "output_reserve": 1024,
                    "safety_margin": 256,
                    "input_price_per_m": 0.15,
                    "output_price_per_m": 0.60,
                },
            ],
            "apiKeys": {"OPENAI_API_KEY": "sk-test"},
            "postgres": {"password": "s3cret"},
        },
    ),
}
KUBE_VERSIONS = (helm.OLDEST_KUBE, helm.NEWEST_KUBE)


def render(
    values: dict[str, Any], kube: str = helm.NEWEST_KUBE, strimzi: bool = False
) -> list[dict[str, Any]]:
    """The chart rendered with `values`; the same values render the same objects, so each distinct render
    runs Helm once per session, and every caller gets its own copy to change."""
    return copy.deepcopy(_render(json.dumps(values, sort_keys=True), kube, strimzi))


@functools.cache
def _render(values_json: str, kube: str, strimzi: bool) -> list[dict[str, Any]]:
    apis = [helm.STRIMZI_API, helm.STRIMZI_USER_API] if strimzi else []
    return helm.render(json.loads(values_json), kube_version=kube, api_versions=apis)


def by_component(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in helm.find(objects, kind)}


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("Deployment", "Job")
    ]


# --- Helm's own checks and Kubernetes' schemas ---------------------------------------------------------


def test_chart_kube_version_range_matches_the_tested_versions() -> None:
    chart = yaml.safe_load((helm.CHART_DIR / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={helm.OLDEST_KUBE}-0"
    assert helm.NEWEST_KUBE in {
        v.removesuffix("-local") for v in kubernetes_validate.utils.all_versions()
    } or (helm.NEWEST_KUBE.rsplit(".", 1)[0] in kubernetes_validate.utils.all_versions())


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_lints_strict_and_installs(profile: str) -> None:
    assert helm.lint(PROFILES[profile]) == []
    objects = helm.install_dry_run(PROFILES[profile])
    assert helm.find(objects, "Deployment"), "a dry-run install renders the Deployments"


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_object_is_valid_kubernetes(profile: str, kube: str) -> None:
    for strimzi in (False, True):
        objects = render(PROFILES[profile], kube, strimzi)
        for obj in objects:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
            if crd is not None:
                jsonschema.validate(obj, crd)
                continue
            try:
                kubernetes_validate.validate(obj, kube, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{name}: no Kubernetes {kube} schema and not an allow-listed CRD")
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} is invalid for Kubernetes {kube}: {exc.message} at {list(exc.path)}")


def test_an_unknown_kind_is_not_waved_through() -> None:
    bogus = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    assert (bogus["apiVersion"], bogus["kind"]) not in CRD_SCHEMAS
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(bogus, helm.NEWEST_KUBE, strict=True)
    bad_topic = {
        "apiVersion": "kafka.strimzi.io/v1beta2",
        "kind": "KafkaTopic",
        "metadata": {"name": "t"},
        "spec": {"partitions": "twelve", "replicas": 3},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_topic, CRD_SCHEMAS[("kafka.strimzi.io/v1beta2", "KafkaTopic")])


# --- bad values are refused with a message ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"postgres": {"host": "pg"}}, "kafka.bootstrapServers is required"),
        ({"kafka": {"bootstrapServers": "k:9092"}}, "postgres.host is required"),
        (merged(BASE, {"kafka": {"bootstrapServers": "no-port"}}), "/kafka/bootstrapServers"),
        (merged(BASE, {"kafka": {"partitions": "twelve"}}), "/kafka/partitions"),
        (merged(BASE, {"replicas": 3}), "additional properties 'replicas' not allowed"),
        (merged(BASE, {"services": {"memory": {"gpus": 1}}}), "additional properties 'gpus' not allowed"),
        (merged(BASE, {"autoscaling": {"mode": "always"}}), "/autoscaling/mode"),
        (
            merged(BASE, {"kafka": {"securityProtocol": "SASL_SSL", "sasl": {"perService": False}}}),
            "kafka.sasl.username is required",
        ),
        (
            merged(BASE, {"kafka": {"sasl": {"perService": False, "username": "u"}}}),
            "kafka.sasl.password or kafka.sasl.existingSecret is required",
        ),
        (merged(BASE, {"kafka": {"securityProtocol": "PLAINTEXT"}}), "set kafka.allowPlaintext=true"),
        (merged(BASE, {"vllm": {"gpuMemoryUtilization": 1.5}}), "/vllm/gpuMemoryUtilization"),
        (merged(BASE, {"vllm": {"enabled": False}}), "state.qtmUrl is required"),
        (merged(BASE, {"modelPool": [{"name": "x", "model": "m"}]}), "missing properties"),
    ],
)
def test_bad_values_are_refused_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.ChartError) as refused:
        helm.install_dry_run(values)
    assert message in str(refused.value)


# --- what matters, asserted -------------------------------------------------------------------------------


def test_vllm_pods_are_scheduled_on_gpu_nodes() -> None:
    for profile in ("default", "gpu"):
        vllm = by_component(render(PROFILES[profile]), "Deployment")["vllm"]
        pod = vllm["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        gpus = str(PROFILES[profile].get("vllm", {}).get("gpus", 1))
        assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
        assert str(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus
        assert f"--tensor-parallel-size={gpus}" in container["args"]
        # The GPU request alone picks GPU nodes; no RuntimeClass or GPU Feature Discovery label is assumed
        # (a RuntimeClass the cluster lacks makes the API refuse the pod: tests/k8s).
        assert "nodeSelector" not in pod
        assert "runtimeClassName" not in pod
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        cache = next(v for v in pod["volumes"] if v["name"] == "cache")
        assert cache["persistentVolumeClaim"]["claimName"] == "mars-vllm-cache"
        assert container["startupProbe"]["httpGet"]["path"] == "/health"
        assert (
            container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 1800
        )
        args = container["args"]
        for flag in (
            "--model=Qwen/Qwen2.5-7B-Instruct",
            "--revision=main",
            "--max-model-len=8192",
            "--guided-decoding-backend=xgrammar",
            "--disable-log-requests",  # prompts (users' turns, memory) stay out of vLLM's log
        ):
            assert flag in args


def test_state_service_uses_the_charts_vllm_server() -> None:
    objects = render(BASE)
    env = helm.service_env(objects, "state")
    vllm_service = helm.find(objects, "Service", "mars-vllm")[0]
    port = vllm_service["spec"]["ports"][0]["port"]
    assert env["MARS_STATE_QTM_BACKEND"] == "openai"
    assert env["MARS_STATE_QTM_URL"] == f"http://mars-vllm:{port}/v1"
    vllm_args = by_component(objects, "Deployment")["vllm"]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert f"--served-model-name={env['MARS_STATE_QTM_MODEL']}" in vllm_args


def test_memory_on_gpu_gets_the_cuda_image_and_a_gpu() -> None:
    plain = by_component(render(BASE), "Deployment")["memory"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in plain["containers"][0]["resources"].get("limits", {})
    assert "nodeSelector" not in plain
    gpu_objects = render(PROFILES["gpu"])
    pod = by_component(gpu_objects, "Deployment")["memory"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("-cuda")
    assert "runtimeClassName" not in pod
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert helm.service_env(gpu_objects, "memory")["MARS_MEMORY_USE_GPU"] == "true"
    assert "MARS_MEMORY_USE_GPU" not in helm.service_env(render(BASE), "memory")


def test_gpu_platform_values_reach_the_pods() -> None:
    """What charts/README.md "GPU nodes" tells GPU Operator users to set lands on both GPU pods."""
    operator = {"runtimeClassName": "nvidia", "nodeSelector": {"nvidia.com/gpu.present": "true"}}
    values = merged(PROFILES["gpu"], {"vllm": operator, "services": {"memory": {"gpu": operator}}})
    deployments = by_component(render(values), "Deployment")
    for component in ("vllm", "memory"):
        pod = deployments[component]["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_service_container_has_grpc_probes(profile: str) -> None:
    deployments = by_component(render(PROFILES[profile]), "Deployment")
    for service in SERVICES:
        (container,) = deployments[service]["spec"]["template"]["spec"]["containers"]
        # With TLS on, the probes use the plaintext health port (Kubernetes' gRPC probes cannot speak TLS).
        probe_port = "health" if PROFILES[profile].get("tls", {}).get("enabled", True) else "grpc"
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe_port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, (service, probe)
        # Readiness asks for the service by name: a port answered by some other server is not "ready".
        assert container["readinessProbe"]["grpc"]["service"].startswith("mars.v1.")
    for name, deployment in deployments.items():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), name


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_pod_is_hardened(profile: str) -> None:
    specs = pod_specs(render(PROFILES[profile]))
    assert len(specs) >= 7
    for name, pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        # Two pods talk to the API server, each with its own account: the Jobs that make the master key
        # Secret and the identity Secrets.
        api_caller = (name, pod.get("serviceAccountName")) in {
            ("Job/mars-master-key", "mars-master-key-maker"),
            ("Job/mars-identity", "mars-identity-maker"),
        }
        assert pod.get("automountServiceAccountToken") is api_caller, name
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert "limits" in container["resources"] and "requests" in container["resources"], name
            # A read-only root still needs a writable /tmp.
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), name


def test_passwords_come_from_secrets_never_from_config_maps() -> None:
    objects = render(PROFILES["kafka-sasl-tls"])
    for config_map in helm.find(objects, "ConfigMap"):
        assert "PASSWORD" not in " ".join(config_map.get("data", {})), config_map["metadata"]["name"]
    container = by_component(objects, "Deployment")["router"]["spec"]["template"]["spec"]["containers"][0]
    refs = {
        v["name"]: v["valueFrom"]["secretKeyRef"]
        for v in container["env"]
        if "valueFrom" in v and "secretKeyRef" in v["valueFrom"]
    }
    assert refs["MARS_KAFKA_SASL_PASSWORD"] == {"name": "kafka-user", "key": "kafka-password"}
    # Its own Postgres role's password (postgres.roles, the default); the admin's only in the migrate Job.
    assert refs["PGPASSWORD"] == {"name": "mars-postgres-router", "key": "password"}
    migrate = by_component(objects, "Job")["migrate"]["spec"]["template"]["spec"]["containers"][0]
    admin = {v["name"]: v.get("valueFrom", {}).get("secretKeyRef", v.get("value")) for v in migrate["env"]}
    assert admin["PGPASSWORD"] == {"name": "pg-credentials", "key": "postgres-password"}
    env = helm.service_env(objects, "router")
    assert env["MARS_KAFKA_SSL_CAFILE"] == "/etc/mars/kafka-tls/ca.crt"
    assert "sslmode=verify-full" in env["MARS_POSTGRES_DSN"]
    assert not helm.find(objects, "Secret", "mars-secrets"), "existing Secrets are used, none is generated"
    own = helm.find(render(PROFILES["hpa-no-vllm"]), "Secret")
    assert {s["metadata"]["name"] for s in own} == {
        "mars-secrets",
        "mars-secrets-api-keys",
    }


def test_each_service_logs_in_to_postgres_as_its_own_role_and_the_migrate_job_makes_them() -> None:
    objects = render(PROFILES["kafka-sasl-tls"])
    env = helm.service_env(objects, "judge")
    assert "@" not in env["MARS_POSTGRES_DSN"], "the DSN names no user: each container's PGUSER does"
    for name, deployment in by_component(objects, "Deployment").items():
        if name in ("gateway", "vllm"):
            continue
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        values = {v["name"]: v.get("value") for v in container["env"]}
        refs = {v["name"]: v["valueFrom"].get("secretKeyRef") for v in container["env"] if "valueFrom" in v}
        assert values["PGUSER"] == f"mars_{name}", name
        assert refs["PGPASSWORD"] == {"name": f"mars-postgres-{name}", "key": "password"}, name
    migrate = by_component(objects, "Job")["migrate"]["spec"]["template"]["spec"]
    args = migrate["containers"][0]["args"]
    assert args[:3] == ["mars", "migrate", "--roles"] and "/etc/mars/postgres-roles" in args
    (volume,) = [v for v in migrate["volumes"] if v["name"] == "postgres-roles"]
    sources = {s["secret"]["name"]: s["secret"] for s in volume["projected"]["sources"]}
    assert set(sources) == {f"mars-postgres-{n}" for n in (*topology.NAMES, "operator")}
    assert all(s["optional"] and s["items"][0]["path"].endswith("/password") for s in sources.values())
    assert volume["projected"]["defaultMode"] == 0o400
    assert "mars-postgres-judge" in helm.notes(PROFILES["kafka-sasl-tls"])
    # Roles off: one login everywhere, in the DSN, as before, and NOTES says what that allows.
    shared_values = merged(PROFILES["kafka-sasl-tls"], {"postgres": {"roles": {"enabled": False}}})
    shared = render(shared_values)
    assert "@" in helm.service_env(shared, "judge")["MARS_POSTGRES_DSN"]
    assert "may read and change every table" in helm.notes(shared_values)
    judge = by_component(shared, "Deployment")["judge"]["spec"]["template"]["spec"]["containers"][0]
    assert "PGUSER" not in {v["name"] for v in judge["env"]}
    assert (
        "--roles"
        not in by_component(shared, "Job")["migrate"]["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_only_the_services_that_seal_mount_the_master_key() -> None:
    """The stage services seal and unseal turn text; the hook Jobs (schema, topics) never touch it, and the
    gateway holds no secret."""
    objects = render(PROFILES["kafka-sasl-tls"])
    workloads = [o for o in objects if o["kind"] in ("Deployment", "Job")]
    assert {o["metadata"]["labels"]["app.kubernetes.io/component"] for o in workloads} >= {
        "migrate",
        "gateway",
    }
    for workload in workloads:
        name = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        env = {v["name"] for c in pod["containers"] for v in c.get("env", [])}
        env |= {
            k
            for c in pod["containers"]
            for ref in c.get("envFrom", [])
            if "configMapRef" in ref
            for k in helm.find(objects, "ConfigMap", ref["configMapRef"]["name"])[0].get("data", {})
        }
        sealing = name in topology.NAMES
        assert ("master-key" in volumes) == sealing, name
        assert ("MARS_MASTER_KEY_FILE" in env) == sealing, name


def test_rendered_model_pool_loads(tmp_path: Any) -> None:
    for profile, arms in (("default", ["qwen2.5-7b-instruct"]), ("hpa-no-vllm", ["gpt-4o-mini"])):
        config_map = helm.find(render(PROFILES[profile]), "ConfigMap", "mars-model-pool")[0]
        path = tmp_path / f"{profile}.yaml"
        path.write_text(config_map["data"]["models.yaml"])
        assert [m.name for m in load_pool(path).models] == arms


def test_hook_jobs_run_real_cli_commands() -> None:
    objects = render(BASE)
    jobs = {j["metadata"]["name"]: j for j in helm.find(objects, "Job")}
    assert set(jobs) == {"mars-migrate", "mars-topics", "mars-master-key", "mars-identity"}
    parser = cli.build_parser()
    for job in jobs.values():
        # Schema and topics after install (the master key before: the pods mount it).
        before = job["metadata"]["name"] in ("mars-master-key", "mars-identity")
        hook = "pre-install" if before else "post-install"
        assert hook in job["metadata"]["annotations"]["helm.sh/hook"]
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "mars"
        parser.parse_args(args[1:])
    env = {
        v["name"]: v.get("value")
        for v in jobs["mars-topics"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["MARS_KAFKA_PARTITIONS"] == "12" and env["MARS_KAFKA_REPLICATION_FACTOR"] == "3"


def test_strimzi_topics_only_where_the_api_exists() -> None:
    without = render(BASE)
    assert not helm.find(without, "KafkaTopic")
    prefixed = merged(BASE, {"kafka": {"topicPrefix": "Prod_A."}})
    topics = helm.find(render(prefixed, strimzi=True), "KafkaTopic")
    from mars.config import ALL_TOPICS

    assert sorted(t["spec"]["topicName"] for t in topics) == sorted(f"Prod_A.{t}" for t in ALL_TOPICS)
    assert all(t["spec"]["partitions"] == 12 and t["spec"]["replicas"] == 3 for t in topics)
    assert all(t["metadata"]["labels"]["strimzi.io/cluster"] == "kafka" for t in topics)
    # With Strimzi managing topics, no topic Job races it.
    jobs = {j["metadata"]["name"] for j in helm.find(render(BASE, strimzi=True), "Job")}
    assert jobs == {"mars-migrate", "mars-master-key", "mars-identity"}


def test_keda_scales_each_stage_on_its_consumer_groups() -> None:
    values = merged(PROFILES["keda"], {"kafka": {"topicPrefix": "p1."}})
    objects = render(values)
    scaled = by_component(objects, "ScaledObject")
    assert set(scaled) == set(STAGES)
    for service in STAGES:
        spec = scaled[service]["spec"]
        assert spec["scaleTargetRef"]["name"] == f"mars-{service}"
        assert spec["maxReplicaCount"] == 6, "capped at the partition count"
        triggers = {(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in spec["triggers"]}
        expected = {
            (f"p1.{g.name}", f"p1.{topic}")
            for g in topology.STAGE_GROUPS
            if g.service == service
            for topic in g.topics
        }
        assert triggers == expected, service
        assert all(t["authenticationRef"]["name"] == "mars-kafka" for t in spec["triggers"])
    # Stages are not given fixed replicas the autoscaler would fight; the ingress scales on CPU.
    deployments = by_component(objects, "Deployment")
    assert all("replicas" not in deployments[s]["spec"] for s in SERVICES)
    assert set(by_component(objects, "HorizontalPodAutoscaler")) == {"ingress"}
    auth = helm.find(objects, "TriggerAuthentication")[0]["spec"]["secretTargetRef"]
    assert {r["parameter"] for r in auth} == {"tls", "sasl", "username", "password", "ca"}
    keda_secret = helm.find(objects, "Secret", "mars-keda-kafka")[0]["stringData"]
    assert keda_secret == {"tls": "enable", "sasl": "scram_sha512", "username": "mars"}


def test_hpa_mode_caps_stages_at_the_partition_count() -> None:
    hpas = by_component(
        render(merged(PROFILES["hpa-no-vllm"], {"kafka": {"partitions": 4}})), "HorizontalPodAutoscaler"
    )
    assert set(hpas) == set(SERVICES)
    assert all(hpas[s]["spec"]["maxReplicas"] == 4 for s in STAGES)
    assert hpas["ingress"]["spec"]["maxReplicas"] == 12


def test_every_service_has_a_disruption_budget() -> None:
    pdbs = by_component(render(BASE), "PodDisruptionBudget")
    assert set(pdbs) == {*SERVICES, "gateway"}
    deployments = by_component(render(BASE), "Deployment")
    for service, pdb in pdbs.items():
        assert (
            pdb["spec"]["selector"]["matchLabels"] == deployments[service]["spec"]["selector"]["matchLabels"]
        )


# --- NetworkPolicy reachability -------------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "the evaluator understands matchLabels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_admits(peer: dict[str, Any], src: dict[str, Any], namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], src["ns_labels"]):
            return False
    elif src["namespace"] != namespace:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], src["labels"])


def reachable(policies: list[dict[str, Any]], src: dict[str, Any], dst: dict[str, Any], port: str) -> bool:
    """Kubernetes NetworkPolicy semantics (ingress side): isolated by any selecting policy, then allowed
    if some rule of a selecting policy admits the source on the port."""
    selecting = [
        p
        for p in policies
        if "Ingress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], dst["labels"])
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p["port"] == port for p in ports):
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_admits(peer, src, "mars") for peer in peers):
                return True
    return False


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    ns_labels = {"kubernetes.io/metadata.name": "mars"}
    pods = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: {
            "labels": o["spec"]["template"]["metadata"]["labels"],
            "namespace": "mars",
            "ns_labels": ns_labels,
        }
        for o in objects
        if o["kind"] in ("Deployment", "Job")
    }
    pods["client"] = {
        "labels": {"app": "web", "mars.io/client": "true"},
        "namespace": "mars",
        "ns_labels": ns_labels,
    }
    pods["neighbour"] = {"labels": {"app": "other"}, "namespace": "mars", "ns_labels": ns_labels}
    pods["outsider"] = {
        "labels": {"app": "web"},
        "namespace": "other",
        "ns_labels": {"kubernetes.io/metadata.name": "other"},
    }
    pods["prometheus"] = {
        "labels": {"app": "prometheus"},
        "namespace": "monitoring",
        "ns_labels": {"kubernetes.io/metadata.name": "monitoring"},
    }
    return pods


def test_network_policies_let_each_service_be_reached_by_its_callers_only() -> None:
    objects = render(PROFILES["networkpolicy"])
    policies = helm.find(objects, "NetworkPolicy")
    pods = _pods(objects)
    sources = ["client", "neighbour", "outsider", "prometheus", "migrate", *SERVICES, "gateway", "vllm"]
    allowed = {
        (src, dst, port)
        for dst in (*SERVICES, "gateway", "vllm")
        for port in ("grpc", "metrics", "http")
        for src in sources
        if reachable(policies, pods[src], pods[dst], port)
    }
    expected = {("client", "ingress", "grpc"), ("client", "gateway", "http"), ("gateway", "ingress", "grpc")}
    expected |= {("migrate", s, "grpc") for s in STAGES}  # tool pods (hook and replay Jobs)
    expected |= {("prometheus", s, "metrics") for s in (*SERVICES, topology.GATEWAY.name)}
    expected |= {(s, "vllm", "http") for s in ("state", "dispatch", "judge")}
    # Services that call another (the topology's permissions name them): the ingress calls state.
    expected |= {
        (caller, spec.name, "grpc")
        for spec in topology.SERVICES
        for callers in spec.permissions.values()
        for caller in callers
        if caller in SERVICE_IDENTITIES
    }
    assert ("ingress", "state", "grpc") in expected
    assert allowed == expected
    # Default values: the ingress takes calls from its own namespace, not from others.
    default = render(BASE)
    default_pods = _pods(default)
    default_policies = helm.find(default, "NetworkPolicy")
    assert reachable(default_policies, default_pods["neighbour"], default_pods["ingress"], "grpc")
    assert not reachable(default_policies, default_pods["outsider"], default_pods["ingress"], "grpc")
    assert not reachable(default_policies, default_pods["neighbour"], default_pods["memory"], "grpc")


def test_restricted_egress_allows_dns_release_pods_and_configured_peers() -> None:
    deny = helm.find(render(PROFILES["networkpolicy"]), "NetworkPolicy", "mars-default-deny")[0]["spec"]
    assert deny["policyTypes"] == ["Ingress", "Egress"]
    rules = deny["egress"]
    assert {"port": 53, "protocol": "UDP"} in rules[0]["ports"]
    assert rules[1]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "mars"
    assert rules[2]["to"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    assert helm.find(render(BASE), "NetworkPolicy", "mars-default-deny")[0]["spec"]["policyTypes"] == [
        "Ingress"
    ]


def test_service_monitor_scrapes_every_service_metrics_port() -> None:
    objects = render(PROFILES["networkpolicy"])
    (monitor,) = helm.find(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    for service in helm.find(objects, "Service"):
        component = service["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in (*SERVICES, "gateway"):
            assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
            assert component in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    assert not helm.find(render(BASE), "ServiceMonitor")


def test_notes_tell_how_to_send_a_first_turn() -> None:
    notes = (helm.CHART_DIR / "templates" / "NOTES.txt").read_text()
    assert "mars send" in notes and "port-forward" in notes and "mars tenant create" in notes
    assert "--api-key" in notes


def test_notes_name_each_insecure_default_in_one_line() -> None:
    # Secure by default: TLS minted and on, Kafka SASL_SSL, Postgres verify-full, identities required.
    assert "Insecure defaults" not in helm.notes(BASE)
    (line,) = [
        x
        for x in helm.notes(merged(BASE, {"tls": {"enabled": False}})).splitlines()
        if x.startswith("Insecure defaults")
    ]
    assert "gRPC without TLS" in line and "sslmode=prefer" in line  # what the user turned off, and with it
    assert "identity" not in line and "Kafka" not in line
    plaintext = merged(BASE, {"kafka": {"securityProtocol": "PLAINTEXT", "allowPlaintext": True}})
    (line,) = [x for x in helm.notes(plaintext).splitlines() if x.startswith("Insecure defaults")]
    assert "Kafka in PLAINTEXT" in line
    hardened = merged(
        PROFILES["tls-mutual"],
        {"kafka": {"securityProtocol": "SSL"}},
    )
    assert "Insecure defaults" not in helm.notes(hardened)
    open_stages = helm.notes(merged(hardened, {"identity": {"enabled": False}}))
    assert "stage services open to any caller (identity.enabled)" in open_stages
    one_login = helm.notes(merged(hardened, {"postgres": {"roles": {"enabled": False}}}))
    assert "one Postgres login for every pod (postgres.roles.enabled)" in one_login


def test_model_pool_schema_is_the_pools_own() -> None:
    """values.schema.json checks pool entries the way the services' loader does (mars.model_pool.ModelSpec)."""
    import json

    from mars.model_pool import ModelSpec

    schema = json.loads((helm.CHART_DIR / "values.schema.json").read_text())
    item = schema["properties"]["modelPool"]["items"]
    assert set(item["properties"]) == set(ModelSpec.model_fields)
    assert set(item["required"]) == {n for n, f in ModelSpec.model_fields.items() if f.is_required()}


def test_replay_job_fits_the_release_it_runs_beside() -> None:
    """`mars deploy replay-job` reads the ConfigMap and Secret the chart renders, and its pod is a tool pod
    the NetworkPolicies let reach the stage services."""
    from datetime import UTC, datetime

    from mars_tools.deploy.replay_job import ReplayJob, replay_job_manifest

    for release, values in (("mars", PROFILES["networkpolicy"]), ("prod", PROFILES["hpa-no-vllm"])):
        objects = helm.render(values, release=release)
        manifest = replay_job_manifest(
            ReplayJob(release=release, namespace="mars", image="m:1"), datetime.now(UTC)
        )
        pod = manifest["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        config_maps = {o["metadata"]["name"] for o in helm.find(objects, "ConfigMap")}
        assert {s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s} <= config_maps
        secret_refs = {
            v["valueFrom"]["secretKeyRef"]["name"] for v in container.get("env", []) if "valueFrom" in v
        }
        chart_secrets = {o["metadata"]["name"] for o in helm.find(objects, "Secret")}
        fullname = "mars" if release == "mars" else f"{release}-mars"
        # The tools' Kafka login (the chart's default: one per principal, made by Strimzi for its KafkaUser).
        # ... and Postgres role (postgres.roles: the Secret the operator makes before installing).
        tools = {f"{fullname}-secrets", f"{fullname}-kafka-operator", f"{fullname}-postgres-operator"}
        assert secret_refs and secret_refs <= chart_secrets | tools
        assert f"{fullname}-postgres-operator" in secret_refs
        login = {v["name"]: v.get("value") for v in container["env"]}
        assert login["MARS_KAFKA_SASL_USERNAME"] == f"{fullname}-kafka-operator"
        identity = {v["name"]: v for v in pod["spec"]["volumes"]}["identity"]["secret"]["secretName"]
        # The identity the chart's Job makes (no identity Secret is in the manifest).
        made = set(run_in_memory(helm.job_args(objects, "identity")))
        assert identity in made and identity.endswith("-identity-replay")
        env = {v["name"]: v.get("value") for v in container["env"]}
        assert env["MARS_IDENTITY_CERT_FILE"] == "/etc/mars/identity/tls.crt"
        if release == "mars":
            policies = helm.find(objects, "NetworkPolicy")
            pods = _pods(objects)
            tool = {
                "labels": pod["metadata"]["labels"],
                "namespace": "mars",
                "ns_labels": pods["client"]["ns_labels"],
            }
            assert all(reachable(policies, tool, pods[s], "grpc") for s in STAGES)


def test_every_secret_volume_that_holds_a_key_is_the_pod_groups_alone() -> None:
    """The services' TLS key, the clients' certificate key, the identity key and the master key are mounted
    0440 (fsGroup), never Kubernetes' default 0644 (every user in the container)."""
    keyed = {"tls", "tls-client", "identity", "master-key", "master-key-previous"}
    values = merged(PROFILES["tls-mutual"], {"eventSealing": {"previousSecret": "old-key"}})
    seen: set[str] = set()
    for name, pod in pod_specs(render(values)):
        for volume in pod.get("volumes", []):
            if volume["name"] in keyed and "secret" in volume:
                holds = {item["key"] for item in volume["secret"].get("items", [])}
                if holds and not holds - {"ca.crt"}:
                    continue  # a CA certificate alone (the gateway's view of the services' Secret)
                seen.add(volume["name"])
                assert volume["secret"].get("defaultMode") == 0o440, (name, volume)
    assert seen == keyed, seen


def test_tls_mounts_the_secret_and_probes_health_in_plaintext() -> None:
    objects = render(PROFILES["tls-mutual"])
    for service in SERVICES:
        env = helm.service_env(objects, service)
        pod = by_component(objects, "Deployment")[service]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/etc/mars/tls"]]["secret"]["secretName"] == "mars-tls"
        assert env["MARS_TLS_CERT_FILE"] == "/etc/mars/tls/tls.crt"
        assert env["MARS_TLS_KEY_FILE"] == "/etc/mars/tls/tls.key"
        assert env["MARS_TLS_CLIENT_CA_FILE"] == "/etc/mars/tls/ca.crt"
        assert container["readinessProbe"]["grpc"]["port"] == int(env["MARS_HEALTH_PORT"])
    plain = helm.service_env(render(merged(BASE, {"tls": {"enabled": False}})), "ingress")
    assert not {k for k in plain if k.startswith("MARS_TLS_") or k == "MARS_HEALTH_PORT"}
    with pytest.raises(helm.ChartError, match=r"tls\.secretName is required"):
        helm.install_dry_run(merged(BASE, {"tls": {"enabled": True, "mint": False}}))
    with pytest.raises(helm.ChartError, match=r"tls\.mint needs identity"):
        helm.install_dry_run(merged(BASE, {"identity": {"mint": False}}))


def test_the_minted_tls_serves_each_service_under_its_service_name(tmp_path: Any) -> None:
    """TLS is on by default, from the identity Job (tls.mint): with the arguments the chart renders, the Job
    makes <fullname>-tls, whose certificate names every service's Service, and a client that trusts its
    ca.crt (as NOTES says to fetch it) reaches a TLS server holding it under the Service's name; a client
    that trusts nothing else refuses it. Nothing of it is in the rendered manifest."""
    import asyncio
    import base64

    import grpc
    from cryptography import x509
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    objects = render(BASE)
    assert not [o for o in helm.find(objects, "Secret") if o["metadata"]["name"].startswith("mars-tls")]
    for service in SERVICES:
        env = helm.service_env(objects, service)
        assert env["MARS_TLS_CERT_FILE"] == "/etc/mars/tls/tls.crt" and env["MARS_HEALTH_PORT"] == "8086"
        volumes = by_component(objects, "Deployment")[service]["spec"]["template"]["spec"]["volumes"]
        assert {v["name"]: v for v in volumes}["tls"]["secret"]["secretName"] == "mars-tls"
    made = run_in_memory(helm.job_args(objects, "identity"))
    tls = {k: base64.b64decode(v) for k, v in made["mars-tls"]["data"].items()}
    assert made["mars-tls"]["type"] == "kubernetes.io/tls" and "mars-tls-ca-key" in made
    names = (
        x509.load_pem_x509_certificate(tls["tls.crt"])
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value.get_values_for_type(x509.DNSName)
    )
    for service in SERVICES:
        assert {f"mars-{service}", f"mars-{service}.mars.svc.cluster.local"} <= set(names), service
    assert "gRPC without TLS" not in helm.notes(BASE) and "mars-tls" in helm.notes(BASE)

    async def health_over_tls(trusted: bytes) -> str:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port(
            "127.0.0.1:0", grpc.ssl_server_credentials([(tls["tls.key"], tls["tls.crt"])])
        )
        await server.start()
        try:
            options = (("grpc.ssl_target_name_override", "mars-ingress"),)
            creds = grpc.ssl_channel_credentials(root_certificates=trusted)
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
                try:
                    reply = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        finally:
            await server.stop(None)

    assert asyncio.run(health_over_tls(tls["ca.crt"])) == "SERVING"
    other = run_in_memory(helm.job_args(helm.render(BASE, release="other"), "identity"))
    stranger_ca = base64.b64decode(other["other-mars-tls"]["data"]["ca.crt"])
    assert asyncio.run(health_over_tls(stranger_ca)) == "UNAVAILABLE"


def test_every_service_opens_sealed_events_with_one_master_key() -> None:
    """Crypto-shredding: one master key, made by the chart once (kept on uninstall) or an existing Secret,
    mounted read-only in every pod, its path the services' MARS_MASTER_KEY_FILE."""

    objects = render(BASE)
    # No render holds a key (a new one per `helm template` would strand every sealed event): a Job makes the
    # Secret in the cluster, once, and keeps an existing one.
    assert not [s for s in helm.find(objects, "Secret") if "master" in s["metadata"]["name"]]
    (job,) = [j for j in helm.find(objects, "Job") if j["metadata"]["name"] == "mars-master-key"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:7] == ["mars", "keys", "ensure-secret", "--name", "mars-master-key", "--key", "master.key"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    (role,) = [r for r in helm.find(objects, "Role") if r["metadata"]["name"] == "mars-master-key-maker"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["mars-master-key"], "verbs": ["get"]},
    ]
    for name, pod in pod_specs(objects):
        # The services alone: the gateway sees no event, the hook Jobs (schema, topics) no text, and the
        # key-making Jobs talk to the API server alone (test_only_the_services_that_seal_mount_the_master_key).
        if not name.startswith("Deployment/") or name.endswith(("-vllm", "-gateway")):
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["master-key"]["secret"]["secretName"] == "mars-master-key", name
        assert volumes["master-key"]["secret"]["defaultMode"] == 0o440, name  # not Kubernetes' 0644
        for container in pod["containers"]:
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["master-key"] == {
                "name": "master-key",
                "mountPath": "/etc/mars/master-key",
                "readOnly": True,
            }, name
    for service in SERVICES:
        assert helm.service_env(objects, service)["MARS_MASTER_KEY_FILE"] == "/etc/mars/master-key/master.key"
    own = render(merged(BASE, {"eventSealing": {"existingSecret": "vault-mars", "key": "kek"}}))
    assert not [s for s in helm.find(own, "Secret") if "master" in s["metadata"]["name"]]
    assert not [j for j in helm.find(own, "Job") if "master-key" in j["metadata"]["name"]]
    pod = by_component(own, "Deployment")["judge"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["master-key"]["secret"]["secretName"] == "vault-mars"
    assert helm.service_env(own, "judge")["MARS_MASTER_KEY_FILE"] == "/etc/mars/master-key/kek"
    rotating = render(merged(BASE, {"eventSealing": {"previousSecret": "mars-master-key-2025"}}))
    assert helm.service_env(rotating, "memory")["MARS_PREVIOUS_MASTER_KEY_FILE"] == (
        "/etc/mars/master-key-previous/master.key"
    )
    for name, pod in pod_specs(rotating):
        if name.startswith("Deployment/") and not name.endswith(("-vllm", "-gateway")):
            previous = {v["name"]: v for v in pod["volumes"]}["master-key-previous"]["secret"]
            assert previous["secretName"] == "mars-master-key-2025" and previous["defaultMode"] == 0o440, name
    assert "MARS_PREVIOUS_MASTER_KEY_FILE" not in helm.service_env(objects, "memory")
    off = render(merged(BASE, {"eventSealing": {"enabled": False}}))
    assert "MARS_MASTER_KEY_FILE" not in helm.service_env(off, "ingress")
    assert not [s for s in helm.find(off, "Secret") if "master" in s["metadata"]["name"]]


def test_the_chart_mints_identities_the_stage_services_verify(tmp_path: Any) -> None:
    """The identity Job's command, run against a fake API server with the arguments the chart renders, makes
    certificates that the stage services' settings (ca.crt, MARS_IDENTITY_SCOPE) accept, for the ingress and
    the replay Job only; nothing of it is in the rendered manifest (so a rollback restores none of it); the
    Job's account may read or replace those Secrets alone; the services mount ca.crt only and fail closed
    without it; identity.enabled=false turns the check off, mint=false renders no Job."""
    import base64

    from mars.identity import CallerIdentity, IdentityVerifier

    objects = render(BASE)
    assert not [o for o in helm.find(objects, "Secret") if "-identity" in o["metadata"]["name"]]
    (job,) = [j for j in helm.find(objects, "Job") if j["metadata"]["name"] == "mars-identity"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["mars", "identity", "ensure-secrets"]
    flags: dict[str, list[str]] = {}
    for flag, value in zip(args[3::2], args[4::2], strict=True):
        flags.setdefault(flag, []).append(value)
    scope = helm.service_env(objects, "router")["MARS_IDENTITY_SCOPE"]
    assert flags["--scope"] == [scope] and scope.startswith("spiffe://cluster.local/ns/")
    assert sorted(flags["--name"]) == ["ingress", "replay"], "only the identities that run in the cluster"
    assert flags["--days"] == ["90"] and flags["--fullname"] == ["mars"]
    (role,) = [r for r in helm.find(objects, "Role") if r["metadata"]["name"] == "mars-identity-maker"]
    named = [r for r in role["rules"] if "resourceNames" in r]
    assert named == [
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": [
                "mars-identity-ca-key", "mars-identity-ca", "mars-identity-replay", "mars-identity-ingress",
                "mars-tls-ca-key", "mars-tls",
            ],
            "verbs": ["get", "update"],
        }
    ]  # fmt: skip

    secrets = run_in_memory(helm.job_args(objects, "identity"))  # what the Job makes with those arguments
    verifier = IdentityVerifier(base64.b64decode(secrets["mars-identity-ca"]["data"]["ca.crt"]), scope=scope)
    for name in flags["--name"]:
        for key in ("tls.crt", "tls.key"):
            (tmp_path / f"{name}-{key}").write_bytes(
                base64.b64decode(secrets[f"mars-identity-{name}"]["data"][key])
            )
        caller = CallerIdentity.from_files(
            str(tmp_path / f"{name}-tls.crt"), str(tmp_path / f"{name}-tls.key")
        )
        method = "/mars.v1.Router/GetPolicy"
        assert caller.name == name and verifier.verify(caller.token(method), method) == name
    for service in SERVICES:
        env = helm.service_env(objects, service)
        assert env["MARS_IDENTITY_CA_FILE"] == "/etc/mars/identity-ca/ca.crt"
        assert "MARS_IDENTITY_REQUIRED" not in env  # the default: required
        pod = by_component(objects, "Deployment")[service]["spec"]["template"]["spec"]
        volume = {v["name"]: v for v in pod["volumes"]}["identity-ca"]["secret"]
        assert volume == {"secretName": "mars-identity-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        # A service holds its own identity's key when it calls another (the ingress), never a tool's.
        own = {f"mars-identity-{service}"} if service in SERVICE_IDENTITIES else set()
        assert {m for m in mounted if "-identity-" in m} == {"mars-identity-ca", *own}, service
    ingress = helm.service_env(objects, "ingress")
    assert ingress["MARS_INGRESS_STATE_ADDR"] == "mars-state:50052"
    assert (ingress["MARS_IDENTITY_CERT_FILE"], ingress["MARS_IDENTITY_KEY_FILE"]) == (
        "/etc/mars/identity/tls.crt",
        "/etc/mars/identity/tls.key",
    )
    # Without the Job, TLS comes from the operator's own Secret too.
    off = render(merged(BASE, {"identity": {"enabled": False}, "tls": {"secretName": "their-tls"}}))
    assert helm.service_env(off, "memory")["MARS_IDENTITY_REQUIRED"] == "false"
    assert not [j for j in helm.find(off, "Job") if j["metadata"]["name"] == "mars-identity"]
    theirs = render(
        merged(
            BASE,
            {"identity": {"mint": False, "scope": "spiffe://example.org/ns/a/b"}, "tls": {"secretName": "t"}},
        )
    )
    assert not [j for j in helm.find(theirs, "Job") if j["metadata"]["name"] == "mars-identity"]
    assert helm.service_env(theirs, "judge")["MARS_IDENTITY_CA_FILE"] == "/etc/mars/identity-ca/ca.crt"
    assert helm.service_env(theirs, "judge")["MARS_IDENTITY_SCOPE"] == "spiffe://example.org/ns/a/b"


def test_postgres_certificates_are_verified_where_tls_is_on() -> None:
    """Default sslmode: prefer on a laptop-style install (it checks no certificate), verify-full where TLS is
    on, against postgres.caSecret's CA (mounted in every MARS pod) or the system CAs."""
    plain = helm.service_env(render(merged(BASE, {"tls": {"enabled": False}})), "memory")["MARS_POSTGRES_DSN"]
    assert plain.endswith("?sslmode=prefer")
    assert helm.service_env(render(BASE), "memory")["MARS_POSTGRES_DSN"].endswith(  # TLS on by default
        "?sslmode=verify-full&sslrootcert=system"
    )
    tls = render(PROFILES["tls-mutual"])
    assert helm.service_env(tls, "memory")["MARS_POSTGRES_DSN"].endswith(
        "?sslmode=verify-full&sslrootcert=system"
    )
    own_ca = render(merged(PROFILES["tls-mutual"], {"postgres": {"caSecret": "pg-ca", "caKey": "root.crt"}}))
    dsn = helm.service_env(own_ca, "judge")["MARS_POSTGRES_DSN"]
    assert dsn.endswith("?sslmode=verify-full&sslrootcert=/etc/mars/postgres-tls/root.crt")
    for name, pod in pod_specs(own_ca):
        if name.endswith(("-vllm", "-gateway", "-master-key", "-identity")):  # none of them talks to Postgres
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["postgres-tls"]["secret"]["secretName"] == "pg-ca", name
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["postgres-tls"] == "/etc/mars/postgres-tls", name
    chosen = render(merged(PROFILES["tls-mutual"], {"postgres": {"sslMode": "require"}}))
    assert helm.service_env(chosen, "router")["MARS_POSTGRES_DSN"].endswith("?sslmode=require")


def test_learned_controller_needs_no_llm_endpoint() -> None:
    """state.qtmBackend=learned: the packaged model, no vLLM URL or model name asked for."""
    objects = render(merged(BASE, {"vllm": {"enabled": False}, "state": {"qtmBackend": "learned"}}))
    env = helm.service_env(objects, "state")
    assert env["MARS_STATE_QTM_BACKEND"] == "learned"
    assert "MARS_STATE_QTM_URL" not in env and "MARS_STATE_QTM_MODEL" not in env


def test_gateway_is_a_keyless_caller_of_the_ingress() -> None:
    """The HTTP gateway: its settings are GatewaySettings', it reaches the ingress's Service (over TLS with
    the release's CA when TLS is on), probes over HTTP, and holds no secret (no Postgres, Kafka or master
    key); gateway.enabled=false renders none of it."""
    from mars_gateway.settings import GatewaySettings

    fields = {env_name(GatewaySettings, name) for name in GatewaySettings.model_fields}
    variants = {
        "plaintext": merged(BASE, {"tls": {"enabled": False}}),
        "default": PROFILES["default"],
        "tls-mutual": PROFILES["tls-mutual"],
    }
    for profile, values in variants.items():
        objects = render(values)
        deployment = by_component(objects, "Deployment")["gateway"]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = helm.service_env(objects, "gateway")
        assert set(env) <= fields, sorted(set(env) - fields)
        # The values parse as the gateway parses them (Helm renders big numbers in e-notation unless cast).
        settings = GatewaySettings.from_env(env)
        assert settings.max_body_bytes == 4 * 1024 * 1024 and settings.http_port == 8080
        assert settings.ingress_addr == "mars-ingress:50051" and settings.http_host == "0.0.0.0"
        assert settings.model_pool == "/etc/mars/pool/models.yaml"
        # Its settings come from its own ConfigMap alone: no Secret, no service's settings.
        assert container["envFrom"] == [{"configMapRef": {"name": "mars-gateway-env"}}]
        assert all("valueFrom" not in e for e in container.get("env", []))
        assert {v["name"] for v in pod["volumes"]} <= {"tmp", "pool", "tls", "tls-client"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["args"] == ["gateway"] and container["securityContext"]["readOnlyRootFilesystem"]
        service = by_component(objects, "Service")["gateway"]
        assert service["spec"]["ports"][0]["targetPort"] == "http"
        if profile == "tls-mutual":
            assert env["MARS_TLS_CA_FILE"] == "/etc/mars/tls/ca.crt"
            assert env["MARS_TLS_CLIENT_CERT_FILE"] == "/etc/mars/tls-client/tls.crt"
            client_secret = {v["name"]: v for v in pod["volumes"]}["tls-client"]["secret"]["secretName"]
            assert client_secret == "mars-tls"  # no clientSecretName: the release's own certificate
            # Only what a caller needs: the CA from the services' Secret, never the services' server key.
            ca_volume = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]
            assert ca_volume["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
        elif profile == "default":  # TLS minted by the identity Job: the gateway trusts its CA, presents none
            assert (
                env["MARS_TLS_CA_FILE"] == "/etc/mars/tls/ca.crt" and "MARS_TLS_CLIENT_CERT_FILE" not in env
            )
            assert {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"] == "mars-tls"
        else:
            assert "MARS_TLS_CA_FILE" not in env
    off = render(merged(BASE, {"gateway": {"enabled": False}}))
    assert not [o for o in off if o["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"]
    ingress_policy = helm.find(off, "NetworkPolicy", "mars-ingress")[0]
    assert len(ingress_policy["spec"]["ingress"]) == 2  # callers and metrics; no gateway rule


def test_the_ingress_calls_state_with_the_client_certificate_under_mutual_tls() -> None:
    """With tls.mutual the ingress presents tls.clientSecretName's certificate to state (client auth usage),
    as the gateway does to the ingress, and trusts the services' CA."""
    objects = render(merged(PROFILES["tls-mutual"], {"tls": {"clientSecretName": "mars-client-tls"}}))
    env = helm.service_env(objects, "ingress")
    assert env["MARS_TLS_CA_FILE"] == "/etc/mars/tls/ca.crt"
    assert (env["MARS_TLS_CLIENT_CERT_FILE"], env["MARS_TLS_CLIENT_KEY_FILE"]) == (
        "/etc/mars/tls-client/tls.crt",
        "/etc/mars/tls-client/tls.key",
    )
    pod = by_component(objects, "Deployment")["ingress"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls-client"]["secret"]["secretName"] == "mars-client-tls"
    assert volumes["identity"]["secret"]["secretName"] == "mars-identity-ingress"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert (mounts["tls-client"], mounts["identity"]) == ("/etc/mars/tls-client", "/etc/mars/identity")
    # No other service holds a client certificate or an identity key.
    state = by_component(objects, "Deployment")["state"]["spec"]["template"]["spec"]
    assert not {"tls-client", "identity"} & {v["name"] for v in state["volumes"]}


# --- Kafka logins: one principal per service, KafkaUsers with the ACLs of mars.kafka_acls ------------------


def _env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {v["name"]: v.get("value", v.get("valueFrom")) for v in container.get("env", [])}


def test_each_service_logs_in_to_kafka_as_its_own_principal_by_default() -> None:
    objects = render(BASE)
    deployments = by_component(objects, "Deployment")
    for name in SERVICES:
        env = _env_of(deployments[name]["spec"]["template"]["spec"]["containers"][0])
        assert env["MARS_KAFKA_SASL_USERNAME"] == f"mars-kafka-{name}"
        assert env["MARS_KAFKA_SASL_PASSWORD"] == {
            "secretKeyRef": {"name": f"mars-kafka-{name}", "key": "password"}
        }
    # Nothing shared: no ConfigMap (the tools', each service's) names a Kafka user, and the chart stores no
    # Kafka password.
    for name in ("mars-env", *(f"mars-{s}-env" for s in SERVICES)):
        (config_map,) = helm.find(objects, "ConfigMap", name)
        assert config_map["data"]["MARS_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert "MARS_KAFKA_SASL_USERNAME" not in config_map["data"], name
    # The hook Jobs (schema, topics) as the tools' principal.
    for job in helm.find(objects, "Job"):
        for container in job["spec"]["template"]["spec"]["containers"]:
            env = _env_of(container)
            if "MARS_KAFKA_BOOTSTRAP" in env:
                assert env["MARS_KAFKA_SASL_USERNAME"] == "mars-kafka-operator", job["metadata"]["name"]


def test_kafka_users_carry_the_acl_table_under_the_release_prefix() -> None:
    from mars.kafka_acls import chart_table, principals

    assert not helm.find(render(BASE), "KafkaUser")  # only where Strimzi's API is installed
    objects = render(merged(BASE, {"kafka": {"topicPrefix": "prod."}}), strimzi=True)
    users = {u["metadata"]["name"]: u for u in helm.find(objects, "KafkaUser")}
    assert set(users) == {f"mars-kafka-{p}" for p in principals()}
    table = chart_table()
    for principal in principals():
        spec = users[f"mars-kafka-{principal}"]["spec"]
        assert spec["authentication"] == {"type": "scram-sha-512"}
        got = {
            (a["resource"]["type"], a["resource"].get("name"), tuple(a["operations"]))
            for a in spec["authorization"]["acls"]
        }
        want = {
            (r["type"], None if r["type"] == "cluster" else ("*" if r["name"] == "*" else "prod." + r["name"]),
             tuple(r["operations"]))
            for r in table[principal]
        }  # fmt: skip
        assert got == want, principal
    dispatch = {
        a["resource"]["name"]: a["operations"]
        for a in users["mars-kafka-dispatch"]["spec"]["authorization"]["acls"]
    }
    assert "Write" in dispatch["prod.mars.turn.generated"]
    assert dispatch["prod.mars.turn.received"] == ["Describe"]  # sees that it exists, nothing more


def test_plaintext_kafka_needs_an_acknowledgement_that_notes_repeat() -> None:
    values = merged(BASE, {"kafka": {"securityProtocol": "PLAINTEXT", "allowPlaintext": True}})
    objects = helm.install_dry_run(values)
    env = helm.service_env(objects, "router")
    assert env["MARS_KAFKA_SECURITY_PROTOCOL"] == "PLAINTEXT" and "MARS_KAFKA_SASL_USERNAME" not in env
    assert "Kafka in PLAINTEXT (kafka.securityProtocol)" in helm.notes(values)


def test_notes_name_the_per_service_logins_and_where_their_secrets_come_from() -> None:
    notes = helm.notes(BASE)
    assert "mars-kafka-<service>" in notes and "mars-kafka-operator" in notes
    assert "kafka-acls.json" in notes  # no Strimzi here: the user makes the users and ACLs
