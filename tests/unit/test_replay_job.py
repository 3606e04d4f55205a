"""`mars deploy replay-job`: the Job manifest follows the chart's names, is hardened, and is a valid
Kubernetes object (checked against Kubernetes' own schema); printing needs no cluster."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml
from mars_tools.cli import build_parser
from mars_tools.deploy.replay_job import ReplayJob, chart_fullname, create_job, replay_job_manifest

NOW = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
K8S_VERSION = "1.29.0"


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_chart_fullname_follows_the_chart() -> None:
    assert chart_fullname("prod") == "prod-mars"
    assert chart_fullname("mars") == "mars"
    assert chart_fullname("mars-staging") == "mars-staging"
    assert chart_fullname("prod", "custom") == "custom"
    # Helm's trunc 40 | trimSuffix "-".
    assert chart_fullname("a" * 39 + "-mars") == "a" * 39
    assert len(chart_fullname("x" * 60)) == 40


def test_manifest_runs_replay_with_the_release_settings() -> None:
    job = ReplayJob(
        release="prod", namespace="ml", image="reg/mars:1.2", replay_args=("read", "--idle-s", "5")
    )
    m = replay_job_manifest(job, NOW)
    validate(m)
    assert m["metadata"]["name"] == "prod-mars-replay-20250304050607"
    assert m["metadata"]["namespace"] == "ml"
    labels = m["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "replay"
    assert labels["mars.io/role"] == "tools"
    assert labels["app.kubernetes.io/instance"] == "prod"
    assert m["spec"]["template"]["metadata"]["labels"] == labels
    pod = m["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == "reg/mars:1.2"
    assert c["args"] == ["mars", "replay", "read", "--idle-s", "5"]
    assert c["envFrom"] == [{"configMapRef": {"name": "prod-mars-env"}}]
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    # The tools' own Kafka principal, as the chart makes it by default (kafka.sasl.perService).
    assert secret_env["MARS_KAFKA_SASL_PASSWORD"] == {
        "name": "prod-mars-kafka-operator",
        "key": "password",
        "optional": True,
    }
    assert {e["name"]: e.get("value") for e in c["env"]}["MARS_KAFKA_SASL_USERNAME"] == "prod-mars-kafka-operator"
    # ... and Postgres role (postgres.roles, the chart's default): the DSN names no user, PGUSER does.
    assert secret_env["PGPASSWORD"] == {"name": "prod-mars-postgres-operator", "key": "password", "optional": True}
    assert {e["name"]: e.get("value") for e in c["env"]}["PGUSER"] == "mars_operator"
    shared = replay_job_manifest(
        ReplayJob(release="prod", namespace="ml", image="i", postgres_role_login=False), NOW
    )
    (plain,) = shared["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in plain["env"] if "valueFrom" in e}[
        "PGPASSWORD"
    ] == "prod-mars-secrets"
    assert "PGUSER" not in {e["name"] for e in plain["env"]}


def test_manifest_is_hardened() -> None:
    m = replay_job_manifest(ReplayJob(release="mars", namespace="default", image="i"), NOW)
    pod = m["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = pod["containers"][0]["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["tmp"]
    mounts = {v["name"]: v["mountPath"] for v in pod["containers"][0]["volumeMounts"]}
    assert mounts["tmp"] == "/tmp"


def test_tls_ca_output_claim_and_existing_secret() -> None:
    job = ReplayJob(
        release="prod",
        namespace="ml",
        image="i",
        replay_args=("export", "--out", "/data/log.jsonl"),
        kafka_ca_secret="kafka-ca",
        kafka_password_secret="kafka-user",
        kafka_shared_login=True,  # the release's one login (kafka.sasl.perService=false)
        postgres_ca_secret="pg-ca",
        pvc="replay-data",
        service_account="mars-tools",
        name="nightly-export",
    )
    m = replay_job_manifest(job, NOW)
    validate(m)
    pod = m["spec"]["template"]["spec"]
    assert m["metadata"]["name"] == "nightly-export"
    assert pod["serviceAccountName"] == "mars-tools"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kafka-tls"]["secret"]["secretName"] == "kafka-ca"
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "replay-data"
    mounts = {v["name"]: v["mountPath"] for v in pod["containers"][0]["volumeMounts"]}
    assert mounts["kafka-tls"] == "/etc/mars/kafka-tls" and mounts["data"] == "/data"
    # The release's DSN names sslrootcert=/etc/mars/postgres-tls/ca.crt when postgres.caSecret is set.
    assert volumes["postgres-tls"]["secret"]["secretName"] == "pg-ca"
    assert mounts["postgres-tls"] == "/etc/mars/postgres-tls"
    # The replay identity (router policy reads) is the chart's Secret by default.
    assert volumes["identity"]["secret"]["secretName"] == "prod-mars-identity-replay"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MARS_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "kafka-user"


def test_job_name_fits_kubernetes() -> None:
    m = replay_job_manifest(ReplayJob(release="r" * 53, namespace="n", image="i"), NOW)
    validate(m)
    assert len(m["metadata"]["name"]) <= 63
    with pytest.raises(ValueError, match="63"):
        replay_job_manifest(ReplayJob(release="r", namespace="n", image="i", name="x" * 64), NOW)
    with pytest.raises(ValueError, match="no replay command"):
        replay_job_manifest(ReplayJob(release="r", namespace="n", image="i", replay_args=()), NOW)


def test_apply_creates_the_job_through_batch_api() -> None:
    class FakeBatch:
        def __init__(self) -> None:
            self.created: list[tuple[str, Any]] = []

        def create_namespaced_job(self, namespace: str, body: Any) -> Any:
            self.created.append((namespace, body))
            return SimpleNamespace(metadata=SimpleNamespace(name=body["metadata"]["name"]))

    batch = FakeBatch()
    m = replay_job_manifest(ReplayJob(release="prod", namespace="ml", image="i"), NOW)
    assert create_job(batch, m) == m["metadata"]["name"]
    assert batch.created == [("ml", m)]


def run_cli(argv: list[str]) -> tuple[int, argparse.Namespace]:
    args = build_parser().parse_args(argv)
    return args.func(args), args


def test_cli_prints_a_valid_manifest(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # printing needs no cluster
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc, _ = run_cli(
        ["deploy", "replay-job", "--image", "reg/mars:1", "--release", "prod", "-n", "ml", "--pvc", "out",
         "--", "export", "--out", "/data/log.jsonl"]
    )  # fmt: skip
    assert rc == 0
    (manifest,) = list(yaml.safe_load_all(capsys.readouterr().out))
    validate(manifest)
    assert manifest["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "mars", "replay", "export", "--out", "/data/log.jsonl"
    ]  # fmt: skip
    assert manifest["metadata"]["namespace"] == "ml"


def test_cli_defaults_to_replay_read_and_refuses_a_bad_replay_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc, _ = run_cli(["deploy", "replay-job", "--image", "i"])
    assert rc == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["spec"]["template"]["spec"]["containers"][0]["args"] == ["mars", "replay", "read"]
    assert manifest["metadata"]["namespace"] == "default"
    rc, _ = run_cli(["deploy", "replay-job", "--image", "i", "--", "rewind"])
    assert rc == 2
    assert "not a valid replay command line" in capsys.readouterr().out
