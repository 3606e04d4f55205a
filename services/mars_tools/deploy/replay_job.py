"""`mars deploy replay-job`: a Kubernetes Job that runs `mars replay ...` in a release's image, with the
release's settings, beside its services (the event log is usually reachable only from inside the cluster).

The manifest follows the chart's names and conventions (charts/mars/templates/_helpers.tpl): settings
from the `<fullname>-env` ConfigMap, the Kafka and Postgres passwords from the `<fullname>-secrets`
Secret (optional), the Kafka CA Secret mounted where MARS_KAFKA_SSL_CAFILE points, the replay tool's service
identity (<fullname>-identity-replay, for the router's policy), the hardened pod and
container security contexts of every MARS pod. `replay_job_manifest` is pure; `create_job` calls the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

#: Where the chart mounts the Kafka CA Secret (its ConfigMap sets MARS_KAFKA_SSL_CAFILE under it).
KAFKA_TLS_DIR = "/etc/mars/kafka-tls"
#: Where the chart mounts the Postgres CA Secret (its DSN's sslrootcert points under it).
POSTGRES_TLS_DIR = "/etc/mars/postgres-tls"
#: Where the replay identity's Secret is mounted (MARS_IDENTITY_CERT_FILE / _KEY_FILE point into it).
IDENTITY_DIR = "/etc/mars/identity"
#: Where --pvc mounts a claim, for replay outputs that must outlive the pod (--out /data/...).
DATA_DIR = "/data"
#: The chart's pod user (values.yaml podSecurityContext); the image's files are readable by it.
DEFAULT_UID = 10001
#: Kubernetes' limit on a Job name (its pods carry it in a label).
MAX_JOB_NAME = 63


def chart_fullname(release: str, override: str = "") -> str:
    """The chart's `mars.fullname`: the override, or the release name when it contains "mars", else
    "<release>-mars"; at most 40 characters, without a trailing "-"."""
    if override:
        name = override
    elif "mars" in release:
        name = release
    else:
        name = f"{release}-mars"
    return name[:40].removesuffix("-")


@dataclass(frozen=True)
class ReplayJob:
    """What a replay Job needs to know about the release it runs beside."""

    release: str
    namespace: str
    image: str
    #: Arguments of `mars replay` (e.g. ("read",), ("export", "--out", "/data/log.jsonl")).
    replay_args: tuple[str, ...] = ("read",)
    #: The chart's fullnameOverride, if the release used one.
    fullname_override: str = ""
    #: The Job's name; "" names it <fullname>-replay-<UTC time>.
    name: str = ""
    image_pull_policy: str = "IfNotPresent"
    service_account: str = ""
    #: Log in to Kafka as the tools' principal of the release (the chart's kafka.sasl.perService, its
    #: default): user <fullname>-kafka-operator, password in the Secret of that name (key `password`).
    #: True: the release's one shared login (user from its ConfigMap, password as below).
    kafka_shared_login: bool = False
    #: With the shared login, the Secret with the Kafka password (key `kafka_password_key`); "" = the chart's
    #: <fullname>-secrets.
    kafka_password_secret: str = ""
    kafka_password_key: str = "kafka-password"
    postgres_password_key: str = "postgres-password"
    #: Log in to Postgres as the tools' role of the release (the chart's postgres.roles, its default):
    #: PGUSER <prefix>_operator, password in the Secret <fullname>-postgres-operator (key `password`).
    #: False: the release's one shared login (the ConfigMap's DSN, PGPASSWORD from <fullname>-secrets).
    postgres_role_login: bool = True
    postgres_role_prefix: str = "mars"
    #: The Secret with the brokers' CA (the chart's kafka.tls.caSecret); "" mounts none.
    kafka_ca_secret: str = ""
    #: The Secret with the Postgres server's CA (the chart's postgres.caSecret, key `postgres_ca_key`),
    #: mounted where the release's DSN points (sslrootcert); "" mounts none.
    postgres_ca_secret: str = ""
    postgres_ca_key: str = "ca.crt"
    #: The replay tool's service identity (a kubernetes.io/tls Secret, mars.identity), which `replay run
    #: --router` needs to read the router's policy: None = the chart's <fullname>-identity-replay, "" = none.
    identity_secret: str | None = None
    #: A PersistentVolumeClaim mounted at /data for outputs; "" mounts none (files in /tmp die with the pod).
    pvc: str = ""
    backoff_limit: int = 0
    ttl_seconds_after_finished: int = 86_400
    active_deadline_seconds: int = 3_600
    run_as_user: int = DEFAULT_UID
    extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def fullname(self) -> str:
        return chart_fullname(self.release, self.fullname_override)

    @property
    def identity(self) -> str:
        return f"{self.fullname}-identity-replay" if self.identity_secret is None else self.identity_secret

    def job_name(self, now: datetime) -> str:
        if self.name:
            return self.name
        return f"{self.fullname}-replay-{now:%Y%m%d%H%M%S}"[:MAX_JOB_NAME].removesuffix("-")


def labels(job: ReplayJob) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "mars",
        "app.kubernetes.io/instance": job.release,
        "app.kubernetes.io/part-of": "mars",
        "app.kubernetes.io/component": "replay",
        "app.kubernetes.io/managed-by": "mars-cli",
        "mars.io/role": "tools",
        **job.extra_labels,
    }


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    # optional: a release without that password (PLAINTEXT Kafka, a passwordless Postgres) still runs.
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def _kafka_login(job: ReplayJob, secrets: str) -> list[dict[str, Any]]:
    if job.kafka_shared_login:
        return [_secret_env("MARS_KAFKA_SASL_PASSWORD", secrets, job.kafka_password_key)]
    user = f"{job.fullname}-kafka-operator"  # the chart's mars.kafkaUser of the tools' principal
    return [
        {"name": "MARS_KAFKA_SASL_USERNAME", "value": user},
        _secret_env("MARS_KAFKA_SASL_PASSWORD", user, "password"),
    ]


def _postgres_login(job: ReplayJob) -> list[dict[str, Any]]:
    if not job.postgres_role_login:
        return [_secret_env("PGPASSWORD", f"{job.fullname}-secrets", job.postgres_password_key)]
    # The chart's DSN names no user where roles are on: libpq takes PGUSER (mars.db_roles).
    return [
        {"name": "PGUSER", "value": f"{job.postgres_role_prefix}_operator"},
        _secret_env("PGPASSWORD", f"{job.fullname}-postgres-operator", "password"),
    ]


def _volumes(job: ReplayJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes, the container's mounts, and the identity settings that go with its mount."""
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "pool", "configMap": {"name": f"{job.fullname}-model-pool", "optional": True}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "pool", "mountPath": "/etc/mars/pool", "readOnly": True},
    ]
    if job.kafka_ca_secret:
        volumes.append({"name": "kafka-tls", "secret": {"secretName": job.kafka_ca_secret}})
        mounts.append({"name": "kafka-tls", "mountPath": KAFKA_TLS_DIR, "readOnly": True})
    if job.postgres_ca_secret:
        items = [{"key": job.postgres_ca_key, "path": job.postgres_ca_key}]
        volumes.append(
            {"name": "postgres-tls", "secret": {"secretName": job.postgres_ca_secret, "items": items}}
        )
        mounts.append({"name": "postgres-tls", "mountPath": POSTGRES_TLS_DIR, "readOnly": True})
    if job.pvc:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": job.pvc}})
        mounts.append({"name": "data", "mountPath": DATA_DIR})
    identity_env: list[dict[str, Any]] = []
    if job.identity:
        volumes.append({"name": "identity", "secret": {"secretName": job.identity}})
        mounts.append({"name": "identity", "mountPath": IDENTITY_DIR, "readOnly": True})
        identity_env = [
            {"name": "MARS_IDENTITY_CERT_FILE", "value": f"{IDENTITY_DIR}/tls.crt"},
            {"name": "MARS_IDENTITY_KEY_FILE", "value": f"{IDENTITY_DIR}/tls.key"},
        ]
    return volumes, mounts, identity_env


def _container(
    job: ReplayJob, secrets: str, mounts: list[dict[str, Any]], identity_env: list[dict[str, Any]]
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "replay",
        "image": job.image,
        "imagePullPolicy": job.image_pull_policy,
        # The image's entrypoint takes a service name or a `mars ...` command line (as the chart's hooks).
        "args": ["mars", "replay", *job.replay_args],
        "envFrom": [{"configMapRef": {"name": f"{job.fullname}-env"}}],
        "env": [
            *_kafka_login(job, secrets),
            *_postgres_login(job),
            # A read-only root: caches (matplotlib for `replay report`) go to the writable /tmp.
            {"name": "HOME", "value": "/tmp"},
            {"name": "MPLCONFIGDIR", "value": "/tmp/matplotlib"},
            *identity_env,
        ],
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"memory": "2Gi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    return container


def replay_job_manifest(job: ReplayJob, now: datetime) -> dict[str, Any]:
    """The batch/v1 Job that runs `mars replay <replay_args>` once (no restarts by default: a failed
    read is reported, not repeated)."""
    if not job.replay_args:
        raise ValueError("no replay command given (e.g. read, export --out /data/log.jsonl)")
    name = job.job_name(now)
    if len(name) > MAX_JOB_NAME:
        raise ValueError(f"Job name {name!r} is {len(name)} characters; Kubernetes allows {MAX_JOB_NAME}")
    secrets = job.kafka_password_secret or f"{job.fullname}-secrets"
    volumes, mounts, identity_env = _volumes(job)
    container = _container(job, secrets, mounts, identity_env)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # Replay reads Kafka (and Postgres), never the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": job.run_as_user,
            "runAsGroup": job.run_as_user,
            "fsGroup": job.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if job.service_account:
        pod_spec["serviceAccountName"] = job.service_account
    job_labels = labels(job)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": job.namespace, "labels": job_labels},
        "spec": {
            "backoffLimit": job.backoff_limit,
            "ttlSecondsAfterFinished": job.ttl_seconds_after_finished,
            "activeDeadlineSeconds": job.active_deadline_seconds,
            "template": {"metadata": {"labels": dict(job_labels)}, "spec": pod_spec},
        },
    }


class BatchApi(Protocol):
    """The call of kubernetes.client.BatchV1Api this module makes."""

    def create_namespaced_job(self, namespace: str, body: Any) -> Any: ...


def create_job(batch: BatchApi, manifest: dict[str, Any]) -> str:
    """Create the Job; its name. Calls the API server."""
    created = batch.create_namespaced_job(manifest["metadata"]["namespace"], manifest)
    return str(created.metadata.name)
