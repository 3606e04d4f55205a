"""The settings the chart hands each deployable (issue 46 item 3: settings per service).

Each deployable (the six services, the gateway) takes its settings from a ConfigMap of its own,
`<fullname>-<deployable>-env`, and what needs a Secret or the pod's name from its container's env. For every
container of every deployable, rendered with the defaults and with value sets that turn the features on
(TLS, mutual TLS, identity, sealing with a key rotation, per-service and shared Kafka logins, Kafka TLS, the
memory service on a GPU, each QTM backend, KEDA/HPA, global and per-service `env`), the names it is handed
are the names its settings model reads today (`mars.config.env_name`: MARS_<SECTION>_<FIELD> for its own
settings, MARS_<FIELD> for the shared ones), none of the flat names of earlier releases, and the model's
own start-up check (`check_environment`, "did you mean") passes; the values parse as the model parses them.
A value set that hands a service a misspelt or an old name shows the same check failing.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
from mars import topology
from mars.config import SECTIONS, CallerSettings, ServiceSettings, env_name, old_env_names
from mars_stack import helm
from mars_tools.settings import ToolSettings
from test_chart import BASE, PROFILES, merged, render

DEPLOYABLES: dict[str, type[CallerSettings]] = topology.deployable_settings()
#: Every name some deployable reads (old ones too): what one deployable's environment may carry for another.
ELSEWHERE = topology.deployable_env_names()


def current_names(cls: type[CallerSettings]) -> set[str]:
    """The names `cls` reads under their current names, and the env-file switch."""
    return {env_name(cls, f) for f in cls.model_fields} | {"MARS_ENV_FILE"}


def old_names(cls: type[CallerSettings]) -> set[str]:
    return {n for f in cls.model_fields for n in old_env_names(cls, f)}


#: Value sets that turn the features on, besides test_chart's profiles.
FEATURES: dict[str, dict[str, Any]] = {
    "everything-on": merged(
        BASE,
        {
            "tls": {"enabled": True, "secretName": "mars-tls", "mutual": True, "clientSecretName": "client"},
            "eventSealing": {"previousSecret": "old-master-key"},
            "kafka": {"tls": {"caSecret": "kafka-ca"}, "topicPrefix": "prod."},
            "postgres": {"caSecret": "pg-ca", "password": "s3cret", "roles": {"enabled": False}},
            "identity": {"mint": False, "scope": "spiffe://example.org/ns/a/b"},
            "apiKeys": {"OPENAI_API_KEY": "sk-test"},
            "env": {"MARS_LOG_LEVEL": "DEBUG", "MARS_UVLOOP": "false", "MARS_JUDGE_LAMBDA_COST": "0.1"},
            "services": {
                "memory": {"gpu": {"enabled": True}, "env": {"MARS_MEMORY_FAISS_THREADS": "4"}},
                "router": {"env": {"MARS_ROUTER_ALPHA": "0.5", "MARS_ROUTER_ROUTING_POLICY": "linucb"}},
                "ingress": {"env": {"MARS_INGRESS_QUOTA_TURNS_PER_S": "5", "MARS_HANDLER_ATTEMPTS": "5"}},
                "dispatch": {"env": {"MARS_DISPATCH_DEFAULT_MAX_TOKENS": "64"}},
            },
            "gateway": {"env": {"MARS_GATEWAY_MAX_BODY_BYTES": "1048576"}, "maxBodyBytes": 8388608},
        },
    ),
    "identity-off-learned-state": merged(
        BASE,
        {
            "identity": {"enabled": False},
            "tls": {"enabled": False},
            "vllm": {"enabled": False},
            "state": {"qtmBackend": "learned"},
            "kafka": {"securityProtocol": "PLAINTEXT", "allowPlaintext": True},
        },
    ),
    "external-qtm": merged(
        BASE,
        {"vllm": {"enabled": False}, "state": {"qtmUrl": "https://llm.example/v1", "qtmModel": "m"}},
    ),
}
VALUE_SETS: dict[str, dict[str, Any]] = {**PROFILES, **FEATURES}


def _deployments(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The deployables' workloads (Deployments, StatefulSets) by component."""
    out = {}
    for obj in objects:
        component = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if obj["kind"] in ("Deployment", "StatefulSet") and component in DEPLOYABLES:
            assert component not in out, f"two workloads for {component}"
            out[component] = obj
    return out


def container_env(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """A container's environment as names and values: the keys of the ConfigMaps (and rendered Secrets) it
    takes whole, then its env list (a Secret's value as a placeholder, the pod's name as a replica's)."""
    data = {
        (o["kind"], o["metadata"]["name"]): {**(o.get("data") or {}), **(o.get("stringData") or {})}
        for o in objects
        if o["kind"] in ("ConfigMap", "Secret")
    }
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            env.update(data[("ConfigMap", source["configMapRef"]["name"])])
        elif "secretRef" in source:
            env.update(data.get(("Secret", source["secretRef"]["name"]), {}))
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = "from-a-secret"
        else:
            env[var["name"]] = "mars-router-0"
    return env


def setting_problems(objects: list[dict[str, Any]]) -> list[str]:
    """Everything wrong with the MARS_* names each deployable's containers are handed: a name its model does
    not read under that name, a flat name of an earlier release, what its start-up check refuses, values
    it cannot parse; empty when nothing is."""
    problems: list[str] = []
    for name, workload in sorted(_deployments(objects).items()):
        cls = DEPLOYABLES[name]
        for container in workload["spec"]["template"]["spec"]["containers"]:
            where = f"{name}/{container['name']}"
            env = container_env(objects, container)
            names = {n for n in env if n.startswith("MARS_")}
            if unread := sorted(names - current_names(cls)):
                problems.append(f"{where}: {unread} are not {cls.__name__}'s current names")
            if old := sorted(names & old_names(cls)):
                problems.append(f"{where}: {old} are old names of {cls.__name__}")
            try:
                cls.check_environment(env, elsewhere=ELSEWHERE)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)  # an old name read would warn
                try:
                    cls.from_env(env)
                except (ValueError, FutureWarning) as exc:
                    problems.append(f"{where}: {cls.__name__} does not take its environment: {exc}")
    return problems


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_each_deployable_is_handed_only_the_names_it_reads(value_set: str) -> None:
    objects = render(VALUE_SETS[value_set])
    assert set(_deployments(objects)) == set(DEPLOYABLES)
    assert setting_problems(objects) == []


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_each_deployable_has_a_config_map_of_its_own(value_set: str) -> None:
    """`<fullname>-<deployable>-env`, taken by its own pods and no other's; the tools' `<fullname>-env` by
    no deployable."""
    objects = render(VALUE_SETS[value_set])
    config_maps = {o["metadata"]["name"]: o for o in helm.find(objects, "ConfigMap")}
    deployments = _deployments(objects)
    for name, workload in deployments.items():
        own = f"mars-{name}-env"
        assert config_maps[own]["metadata"]["labels"]["app.kubernetes.io/component"] == name
        for container in workload["spec"]["template"]["spec"]["containers"]:
            taken = [s["configMapRef"]["name"] for s in container.get("envFrom", []) if "configMapRef" in s]
            assert taken == [own], (name, taken)
    env_maps = {n for n in config_maps if n.endswith("-env")}
    assert env_maps == {"mars-env"} | {f"mars-{n}-env" for n in deployments}
    # The gateway holds no service setting (Kafka, Postgres, identity CA, master key): a caller's only.
    gateway = config_maps["mars-gateway-env"]["data"]
    assert set(gateway) <= current_names(DEPLOYABLES["gateway"])
    assert not {n for n in gateway if n in current_names(ServiceSettings) - current_names(CallerSettings)}


def test_a_misspelt_or_old_name_in_a_services_env_is_flagged() -> None:
    """The check above fails where it should: a misspelt name, an old flat name, and a name of another
    deployable given to a service through its `env` value."""
    values = merged(
        BASE,
        {
            "services": {
                "router": {"env": {"MARS_ROUTER_ALHPA": "0.5"}},
                "state": {"env": {"MARS_QTM_BACKEND": "rules"}},
                "judge": {"env": {"MARS_MEMORY_USE_GPU": "true"}},
            },
            "gateway": {"env": {"MARS_HTTP_PORT": "9000"}},
        },
    )
    problems = setting_problems(render(values))
    text = "\n".join(problems)
    assert "MARS_ROUTER_ALHPA is not a setting of RouterSettings; did you mean MARS_ROUTER_ALPHA?" in text
    assert "state/state: ['MARS_QTM_BACKEND'] are old names of StateSettings" in text
    assert "judge/judge: ['MARS_MEMORY_USE_GPU'] are not JudgeSettings's current names" in text
    assert "gateway/gateway: ['MARS_HTTP_PORT'] are old names of GatewaySettings" in text
    assert not [p for p in problems if p.startswith(("memory/", "dispatch/", "ingress/"))]


def test_the_global_env_reaches_the_deployables_that_read_it() -> None:
    """`env` is the place for the shared settings: every service gets them; a name in a deployable's section
    reaches that deployable alone; the gateway takes the caller's names as they are, the service settings it
    has as its own (log level, uvloop, metrics port) under its section, and nothing else. Every field of the
    shared models is tried, so the chart's lists are the models'."""
    shared = {env_name(ServiceSettings, f): "x" for f in ServiceSettings.model_fields}
    sectioned = {f"MARS_{s}_SOMETHING": s for s in SECTIONS}
    objects = render(merged(BASE, {"env": {**shared, **sectioned}}))
    gateway_cls = DEPLOYABLES["gateway"]
    for name, workload in _deployments(objects).items():
        env = container_env(objects, workload["spec"]["template"]["spec"]["containers"][0])
        got = {n for n in env if n.endswith("_SOMETHING")}
        assert got == {f"MARS_{name.upper()}_SOMETHING"}, name
        if name == "gateway":
            caller = {env_name(CallerSettings, f) for f in CallerSettings.model_fields}
            own = {
                env_name(gateway_cls, f)
                for f in gateway_cls.model_fields
                if f in ServiceSettings.model_fields and f not in CallerSettings.model_fields
            }
            assert own == {"MARS_GATEWAY_LOG_LEVEL", "MARS_GATEWAY_UVLOOP", "MARS_GATEWAY_METRICS_PORT"}
            # Every name it reads is set, the caller's and its log level and loop from the global env ...
            assert set(env) == (current_names(gateway_cls) - {"MARS_ENV_FILE"}) | {"MARS_GATEWAY_SOMETHING"}
            assert caller | own <= set(env)
            assert env["MARS_GATEWAY_LOG_LEVEL"] == env["MARS_GATEWAY_UVLOOP"] == "x"
            assert env["MARS_IDENTITY_CERT_FILE"] == env["MARS_TLS_CLIENT_KEY_FILE"] == "x"
            # ... but where the chart sets one itself: the ingress's CA, metrics.port.
            assert env["MARS_TLS_CA_FILE"] == "/etc/mars/tls/ca.crt"
            assert env["MARS_GATEWAY_METRICS_PORT"] == "9464"
        else:
            assert env["MARS_LOG_LEVEL"] == "x" and env["MARS_TOPIC_PREFIX"] == "x", name
            # The chart's own settings of the service win over the global env (as the container's did).
            assert env["MARS_GRPC_PORT"] != "x", name


def test_a_changed_setting_rolls_its_deployables_pods_alone() -> None:
    def checksums(values: dict[str, Any]) -> dict[str, str]:
        return {
            name: w["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            for name, w in _deployments(render(values)).items()
        }

    before = checksums(BASE)
    router = checksums(merged(BASE, {"services": {"router": {"env": {"MARS_ROUTER_ALPHA": "2"}}}}))
    assert {n for n in before if before[n] != router[n]} == {"router"}
    everyone = checksums(merged(BASE, {"env": {"MARS_LOG_LEVEL": "DEBUG"}}))
    assert {n for n in before if before[n] != everyone[n]} == set(DEPLOYABLES)
    pool = checksums(merged(BASE, {"vllm": {"maxModelLen": 4096}}))  # the model pool: every reader
    assert {"router", "dispatch", "gateway"} <= {n for n in before if before[n] != pool[n]}


def test_every_settings_name_the_chart_mentions_is_current() -> None:
    """Templates, values (comments included), the values schema and charts/README.md name settings by
    their current names: a deployable's, or a tool's (`mars send`, the replay Job)."""
    known = set().union(*(current_names(cls) for cls in DEPLOYABLES.values())) | current_names(ToolSettings)
    chart = helm.CHART_DIR
    files = [*chart.joinpath("templates").iterdir(), chart / "values.yaml", chart / "values.schema.json"]
    files.append(chart.parent / "README.md")
    unknown = {
        f"{path.name}: {name}"
        for path in files
        for name in re.findall(r"\bMARS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
        if name not in known
    }
    assert not unknown, sorted(unknown)
