"""The service image (infra/image) end to end: built once with infra/image/build.sh, then the six services run
from it as podman containers, hardened as the chart runs them (read-only root filesystem, non-root user, no
capabilities, no privilege escalation, a tmpfs /tmp), against the local stack's Kafka, Postgres and stand-in
LLM on the host; all six answer grpc.health.v1 as SERVING and one turn goes through the ingress.

Run by `make test-image` (not by `make test`: pyproject's addopts ignore tests/image). Needs podman, which
the build script installs from Debian's packages when missing (as root). Without podman and without root it
skips, saying why; anything else that keeps podman from working fails the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars import tls, topology
from mars.config import TOPIC_RECEIVED
from mars.identity import CallerIdentity, with_identity
from mars.tls import ClientTls
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack, StackSettings, helm
from mars_stack.certs import LocalCerts, make_local_ca
from mars_stack.readiness import free_port
from mars_tools.deploy.identity_secrets import run_in_memory
from mars_tools.replay.readers import read_topics
from mars_tools.replay.traces import RawRecord

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "infra" / "image" / "build.sh"
IMAGE = os.environ.get("MARS_IMAGE", "localhost/mars:latest")
#: The stand-in LLM's arms, given to the chart as its modelPool value.
POOL = REPO / "config" / "models.standin.yaml"
#: Where the chart mounts its model-pool ConfigMap (MARS_ROUTER_MODEL_POOL, MARS_DISPATCH_MODEL_POOL and
#: MARS_GATEWAY_MODEL_POOL point at models.yaml in it).
POOL_DIR_IN_CONTAINER = "/etc/mars/pool"
#: Where the chart mounts the tls Secret.
TLS_DIR_IN_CONTAINER = "/etc/mars/tls"
#: Where the chart mounts the master key of the users' data keys (eventSealing).
MASTER_KEY_DIR_IN_CONTAINER = "/etc/mars/master-key"
#: Where the chart mounts the identity CA's certificate (the stage services check callers against it).
IDENTITY_CA_DIR_IN_CONTAINER = "/etc/mars/identity-ca"
UID = "10001"
#: The hardening the chart's securityContext asks for, in podman's words.
HARDENED = [
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs=/tmp:rw,size=256m,mode=1777",
    f"--user={UID}:{UID}",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
]

#: A cold build (base, wheelhouse, all layers) takes ~5 minutes here; then the stack and six containers.
pytestmark = pytest.mark.timeout(1800)


def podman_env() -> dict[str, str]:
    """The environment podman runs with: the repository's containers.conf and storage.conf (as `make image`)."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(REPO / "infra" / "image" / "containers.conf"))
    env.setdefault("CONTAINERS_STORAGE_CONF", str(REPO / "infra" / "image" / "storage.conf"))
    return env


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}"
        )
    return result


def chart_values(stack: LocalStack) -> dict[str, Any]:
    """Values for charts/mars that point the release at the local stack: its Kafka, Postgres and stand-in LLM
    (as the model pool's arms and as the state controller's OpenAI endpoint, in place of vLLM)."""
    dsn = urlsplit(stack.env["MARS_POSTGRES_DSN"])
    llm = stack.env["MARS_LOCAL_LLM_URL"]
    arms = yaml.safe_load(POOL.read_text())["models"]
    for arm in arms:
        arm["base_url"] = f"{llm}/v1"
    return {
        "kafka": {
            "bootstrapServers": stack.env["MARS_KAFKA_BOOTSTRAP"],
            "partitions": stack.settings.partitions,
            "replicationFactor": 1,
            # The containers get the chart's plain env (no Secrets here): a plaintext broker.
            "securityProtocol": "PLAINTEXT",
            "allowPlaintext": True,
        },
        "postgres": {
            "host": dsn.hostname,
            "port": dsn.port,
            "database": dsn.path.lstrip("/"),
            "user": dsn.username,
            "sslMode": "disable",
        },
        "vllm": {"enabled": False},
        "state": {"qtmBackend": "openai", "qtmUrl": f"{llm}/v1", "qtmModel": "standin"},
        "modelPool": arms,
        # Mutual TLS on every service, from a kubernetes.io/tls Secret (the test mounts a local CA's files).
        "tls": {"enabled": True, "secretName": "mars-tls", "mutual": True},
    }


def service_env(
    objects: list[dict[str, Any]], service: str, port: int, metrics_port: int, health_port: int
) -> dict[str, str]:
    """The environment the chart renders for one service's container, as the pod would get it, with what host
    networking changes: each container listens on loopback, on ports of its own."""
    env = helm.service_env(objects, service, pod_name=f"mars-{service}-0")
    assert env["MARS_TLS_CERT_FILE"].startswith(TLS_DIR_IN_CONTAINER), env
    env.update(
        MARS_GRPC_HOST="127.0.0.1",
        MARS_GRPC_PORT=str(port),
        MARS_METRICS_PORT=str(metrics_port),
        MARS_HEALTH_PORT=str(health_port),
    )
    return env


def tls_secret(folder: Path) -> LocalCerts:
    """A local CA's files, readable as a mounted Secret is (0644) by the containers' non-root user."""
    certs = make_local_ca(folder)
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
    return certs


def read_records(bootstrap: str, topic: str) -> list[RawRecord]:
    import asyncio

    async def read() -> list[RawRecord]:
        return [r async for r in read_topics(bootstrap, (topic,), idle_s=1.5)]

    return asyncio.run(read())


def mounted_secret(data: dict[str, str], folder: Path) -> Path:
    """A Secret's data written out as Kubernetes mounts it (readable files, one per key)."""
    import base64

    folder.mkdir()
    for name, value in data.items():
        (folder / name).write_bytes(base64.b64decode(value))
        (folder / name).chmod(0o644)
    folder.chmod(0o755)
    return folder


def master_key_secret(objects: list[dict[str, Any]], folder: Path) -> Path:
    """The master-key Secret as the chart's Job makes it (`mars keys ensure-secret`: the chart renders no key),
    mounted."""
    from mars_tools.deploy.master_key_secret import secret_manifest

    (job,) = [j for j in helm.find(objects, "Job") if j["metadata"]["name"] == "mars-master-key"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    name, key = args[args.index("--name") + 1], args[args.index("--key") + 1]
    return mounted_secret(secret_manifest(name, key, {})["data"], folder)


def identity_secret(objects: list[dict[str, Any]], name: str, folder: Path) -> Path:
    """One of the identity Secrets the chart's Job makes (the CA bundle's, or an identity's), mounted."""
    global _IDENTITY_SECRETS
    if _IDENTITY_SECRETS is None:  # one run of the Job for the whole release, as in a cluster
        _IDENTITY_SECRETS = run_in_memory(helm.job_args(objects, "identity"))
    return mounted_secret(_IDENTITY_SECRETS[name]["data"], folder)


_IDENTITY_SECRETS: dict[str, dict[str, Any]] | None = None


def main_port_health(port: int, client_tls: ClientTls) -> int:
    """grpc.health.v1 on a service's TLS port, as a caller with `client_tls` sees it (UNKNOWN if refused)."""
    with tls.channel(f"127.0.0.1:{port}", client_tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return int(health_pb2.HealthCheckResponse.UNKNOWN)
        return int(reply.status)


def health(port: int, service: str) -> int:
    """The grpc.health.v1 status of `service` at 127.0.0.1:port (UNKNOWN when nothing answers yet)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)
        except grpc.RpcError:
            return int(health_pb2.HealthCheckResponse.UNKNOWN)


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built (or brought up to date, quickly: cached layers) by the same script as `make image`."""
    if shutil.which("podman") is None and os.geteuid() != 0:
        pytest.skip("podman is not installed and this is not root, so the build script cannot install it")
    env = {**os.environ, "PYTHON": sys.executable}  # tags localhost/mars:latest, or MARS_IMAGE when set
    started = time.monotonic()
    result = subprocess.run(["bash", str(BUILD)], env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, f"image build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    print(f"image {IMAGE}: built in {time.monotonic() - started:.0f}s, {size / 1e6:.0f} MB")
    return IMAGE


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Kafka, Postgres and the stand-in LLM from the local stack launcher; no services (they run in podman)."""
    stack = LocalStack(
        StackSettings(
            workdir=tmp_path_factory.mktemp("image") / "stack",
            services=(),
            llm="standin",
            model_pool=POOL,
            kafka_security="plaintext",  # the containers run with the chart's env, which has no Secrets here
        )
    ).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_image_is_hardened(image: str) -> None:
    config = podman("image", "inspect", "--format", "{{.Config.User}}|{{json .Config.Entrypoint}}", image)
    user, entrypoint = config.stdout.strip().split("|")
    assert user.split(":")[0] == UID
    assert "mars-entrypoint" in entrypoint
    probe = podman(
        "run", "--rm", "--network=none", *HARDENED, image,
        "sh", "-c", "id -u; command -v pip pip3 gcc cc apt-get || true; ls /opt/mars/onnx; python -V; "
        "python -c 'import importlib.util as u; print(u.find_spec(\"torch\"))'; touch /opt/mars/x 2>&1 || true",
    )  # fmt: skip
    out = probe.stdout
    lines = out.splitlines()
    assert lines[0] == UID
    assert not [line for line in lines if line.startswith("/")], f"build tools in the image:\n{out}"
    assert any(line.endswith(".onnx") and "int8" not in line for line in lines), out
    assert any(line.endswith(".int8.onnx") for line in lines), out
    assert "Python 3.11." in out
    assert "None" in lines, out  # the CPU image has no torch
    assert "Read-only file system" in out, out


def test_six_services_and_the_gateway_serve_and_answer_turns(
    image: str, infra: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The containers get exactly the environment, model pool and TLS files the Helm chart gives its pods:
    mutual TLS on every gRPC port, health alone in plaintext on the probes' port."""
    objects = helm.render(chart_values(infra))
    certs = tls_secret(tmp_path / "tls")
    client = ClientTls(str(certs.ca), str(certs.client_cert), str(certs.client_key))
    # The test's own calls (ingress_channel reads these) go over mutual TLS, as a caller's would.
    monkeypatch.setenv("MARS_TLS_CA_FILE", client.ca_file)
    monkeypatch.setenv("MARS_TLS_CLIENT_CERT_FILE", client.cert_file)
    monkeypatch.setenv("MARS_TLS_CLIENT_KEY_FILE", client.key_file)
    master_dir = master_key_secret(objects, tmp_path / "master-key")
    identity_ca_dir = identity_secret(objects, "mars-identity-ca", tmp_path / "identity-ca")
    # The ingress calls state (a history import's context) with its own identity and, for mutual TLS, the
    # certificate of tls.clientSecretName, as the chart mounts them in the ingress pod.
    ingress_identity_dir = identity_secret(objects, "mars-identity-ingress", tmp_path / "identity-ingress")
    client_dir = tmp_path / "tls-client"
    client_dir.mkdir()
    (client_dir / "tls.crt").write_bytes(certs.client_cert.read_bytes())
    (client_dir / "tls.key").write_bytes(certs.client_key.read_bytes())
    for path in (client_dir, *client_dir.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    (pool_dir / "models.yaml").write_text(
        helm.find(objects, "ConfigMap", "mars-model-pool")[0]["data"]["models.yaml"]
    )
    run_id = uuid.uuid4().hex[:8]
    ports = {service: free_port() for service in topology.NAMES}
    metrics_ports = {service: free_port() for service in topology.NAMES}
    health_ports = {service: free_port() for service in topology.NAMES}
    names = {service: f"mars-test-{service}-{run_id}" for service in topology.NAMES}
    started: list[str] = []
    try:
        for service in topology.NAMES:
            env = service_env(objects, service, ports[service], metrics_ports[service], health_ports[service])
            # Its own Postgres role (postgres.roles, the chart's default): PGUSER from the chart, the password
            # as the pod gets it from the Secret <fullname>-postgres-<service> (the local stack made the roles).
            assert env["PGUSER"] == f"mars_{service}" and "@" not in env["MARS_POSTGRES_DSN"]
            env["PGPASSWORD"] = infra.postgres_logins[service]
            own: list[str] = []
            if service == "ingress":
                # The chart's address of state; host networking here.
                assert env["MARS_INGRESS_STATE_ADDR"] == "mars-state:50052"
                env["MARS_INGRESS_STATE_ADDR"] = f"127.0.0.1:{ports['state']}"
                own = [f"--volume={ingress_identity_dir}:/etc/mars/identity:ro",
                       f"--volume={client_dir}:/etc/mars/tls-client:ro"]  # fmt: skip
            env_args = [f"--env={k}={v}" for k, v in sorted(env.items())]
            podman(
                "run", "--detach", f"--name={names[service]}", "--network=host", *HARDENED,
                f"--volume={pool_dir}:{POOL_DIR_IN_CONTAINER}:ro",
                f"--volume={certs.ca.parent}:{TLS_DIR_IN_CONTAINER}:ro",
                f"--volume={master_dir}:{MASTER_KEY_DIR_IN_CONTAINER}:ro",
                f"--volume={identity_ca_dir}:{IDENTITY_CA_DIR_IN_CONTAINER}:ro", *own, *env_args, image, service,
            )  # fmt: skip
            started.append(names[service])

        deadline = time.monotonic() + 240
        waiting = set(topology.NAMES)
        while waiting and time.monotonic() < deadline:
            for service in sorted(waiting):
                state = podman("inspect", "--format", "{{.State.Status}}", names[service]).stdout.strip()
                if state != "running":
                    logs = podman("logs", names[service], check=False)
                    pytest.fail(f"{service} container is {state}:\n{(logs.stdout + logs.stderr)[-4000:]}")
                if (
                    health(health_ports[service], topology.service(service).grpc_service)
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    waiting.discard(service)
            time.sleep(0.5)
        if waiting:
            logs = {s: podman("logs", names[s], check=False) for s in sorted(waiting)}
            pytest.fail(
                "not SERVING after 240s: "
                + "; ".join(f"{s}:\n{(r.stdout + r.stderr)[-2000:]}" for s, r in logs.items())
            )
        # The overall status too ("" = the server), and the memory service's dense retrieval: the embedder
        # loaded from the ONNX export baked into the image (its failure would leave lexical-only views).
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in topology.NAMES:
            assert health(health_ports[service], "") == serving, service
            # The gRPC port itself: mutual TLS only (no plaintext, no caller without a certificate).
            assert main_port_health(ports[service], client) == serving, service
            assert main_port_health(ports[service], ClientTls()) != serving, service
            assert main_port_health(ports[service], ClientTls(ca_file=str(certs.ca))) != serving, service
        assert health(health_ports["memory"], "mars.v1.Memory.dense") == serving
        # The stage services answer the chart's tool identities only: the replay Secret opens the router,
        # the caller with the client certificate alone (no identity) gets UNAUTHENTICATED.
        # (The replay Job's identity, one the chart mints by default: it may read the router's policy.)
        operator_dir = identity_secret(objects, "mars-identity-replay", tmp_path / "identity-replay")
        operator = CallerIdentity.from_files(str(operator_dir / "tls.crt"), str(operator_dir / "tls.key"))
        policy = svc.PolicyRequest(tenant="image", user_id="u1")
        with tls.channel(f"127.0.0.1:{ports['router']}", client) as channel:
            assert svc_grpc.RouterStub(with_identity(channel, operator)).GetPolicy(policy, timeout=30).arms
            with pytest.raises(grpc.RpcError) as anonymous:
                svc_grpc.RouterStub(channel).GetPolicy(policy, timeout=30)
            assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Each service's Prometheus endpoint, where the chart's ServiceMonitor scrapes it.
        for service in topology.NAMES:
            scrape = httpx.get(f"http://127.0.0.1:{metrics_ports[service]}/metrics", timeout=10)
            assert scrape.status_code == 200 and "# TYPE" in scrape.text, service

        # A tenant and its API key, made by the image's CLI against the stack's Postgres (the key is the last
        # line of its output), then one turn through the containerised ingress, as `mars send` sends it.
        created = podman(
            "run", "--rm", "--network=host", *HARDENED, image,
            "mars", "tenant", "create", "image", "--postgres-dsn", infra.env["MARS_POSTGRES_DSN"],
        )  # fmt: skip
        api_key = created.stdout.strip().splitlines()[-1]
        assert api_key.startswith("mars_"), created.stdout + created.stderr
        with ingress_channel(f"127.0.0.1:{ports['ingress']}", "") as channel:
            with pytest.raises(grpc.RpcError) as refused:  # the chart's ingress wants a key
                svc_grpc.IngressStub(channel).SendTurn(
                    svc.TurnRequest(tenant="image", user_id="u1", text="no key"), timeout=30
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ingress_channel(f"127.0.0.1:{ports['ingress']}", api_key) as channel:
            reply = svc_grpc.IngressStub(channel).SendTurn(
                svc.TurnRequest(
                    tenant="image", user_id="u1", session_id="s1", text="Hello from the image test"
                ),
                timeout=120,
            )
        assert reply.text.strip(), reply
        assert reply.model in {"standin-short", "standin-long"}, reply.model

        # A history import: the containerised ingress hands its context to the containerised state service
        # (mutual TLS and the ingress identity, as the chart wires them); state keeps it in its table.
        import psycopg
        from mars.auth import mint_key

        admin_key = mint_key(infra.env["MARS_POSTGRES_DSN"], "image", admin=True, label="image test").key
        recorded = svc.RecordedTurn(
            session_id="old", user_text="Plan the Lisbon ferry", assistant_text="Booked."
        )
        with ingress_channel(f"127.0.0.1:{ports['ingress']}", admin_key) as channel:
            imported = svc_grpc.IngressStub(channel).ImportHistory(
                svc.ImportHistoryRequest(user_id="u-import", turns=[recorded]), timeout=60
            )
        assert imported.imported == 1
        with psycopg.connect(infra.env["MARS_POSTGRES_DSN"]) as conn:
            context = conn.execute(
                "SELECT recent_texts, last_seq FROM state_context WHERE tenant = 'image' AND user_id = 'u-import'"
            ).fetchall()
        assert context == [(["Plan the Lisbon ferry"], imported.last_seq)]

        # The CLI in the image (what the chart's hook Jobs run), hardened the same way: a second turn.
        cli = podman(
            "run", "--rm", "--network=host", *HARDENED, f"--volume={certs.ca.parent}:/etc/mars/client-tls:ro",
            "--env=MARS_TLS_CA_FILE=/etc/mars/client-tls/ca.crt",
            "--env=MARS_TLS_CLIENT_CERT_FILE=/etc/mars/client-tls/client.crt",
            "--env=MARS_TLS_CLIENT_KEY_FILE=/etc/mars/client-tls/client.key", image,
            "mars", "send", "--target", f"127.0.0.1:{ports['ingress']}", "--user", "u1", "--session", "s1",
            "--tenant", "image", "--api-key", api_key, "--timeout", "120", "And a second turn from the CLI",
        )  # fmt: skip
        assert "standin-" in cli.stdout, cli.stdout + cli.stderr

        # The OpenAI-compatible gateway, as the chart runs it: a caller of the containerised ingress over
        # mutual TLS (its client certificate mounted as tls.clientSecretName's Secret would be), one completion.
        gateway_port, gateway_metrics = free_port(), free_port()
        gateway_env = helm.service_env(objects, "gateway")
        gateway_env.update(
            MARS_GATEWAY_HTTP_HOST="127.0.0.1",
            MARS_GATEWAY_HTTP_PORT=str(gateway_port),
            MARS_GATEWAY_METRICS_PORT=str(gateway_metrics),
            MARS_GATEWAY_INGRESS_ADDR=f"127.0.0.1:{ports['ingress']}",
        )
        gateway_name = f"mars-test-gateway-{run_id}"
        podman(
            "run", "--detach", f"--name={gateway_name}", "--network=host", *HARDENED,
            f"--volume={pool_dir}:{POOL_DIR_IN_CONTAINER}:ro",
            f"--volume={certs.ca.parent}:{TLS_DIR_IN_CONTAINER}:ro",
            f"--volume={client_dir}:/etc/mars/tls-client:ro",
            *[f"--env={k}={v}" for k, v in sorted(gateway_env.items())], image, "gateway",
        )  # fmt: skip
        started.append(gateway_name)
        base = f"http://127.0.0.1:{gateway_port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            logs = podman("logs", gateway_name, check=False)
            pytest.fail(f"gateway not ready after 60s:\n{(logs.stdout + logs.stderr)[-3000:]}")
        completion = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json={"model": "mars", "user": "u1", "messages": [{"role": "user", "content": "Hi via HTTP"}]},
            timeout=120,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] in {"standin-short", "standin-long"}
        scrape = httpx.get(f"http://127.0.0.1:{gateway_metrics}/metrics", timeout=10)
        assert 'route="/v1/chat/completions"' in scrape.text, scrape.text[-2000:]
        # The turns' text went over Kafka sealed with the user's data key (the chart's master key wraps it).
        received = read_records(infra.env["MARS_KAFKA_BOOTSTRAP"], TOPIC_RECEIVED)
        assert len(received) >= 2 and not [r for r in received if b"from the image test" in r.value]
        assert all(ev.TurnReceived.FromString(r.value).turn.data_key_id for r in received)

        # Nothing died along the way (a write outside /tmp on the read-only root would have crashed it).
        for service in topology.NAMES:
            state = podman("inspect", "--format", "{{.State.Status}}", names[service]).stdout.strip()
            assert state == "running", f"{service} is {state}"
        assert podman("inspect", "--format", "{{.State.Status}}", gateway_name).stdout.strip() == "running"
    finally:
        for name in started:
            with contextlib.suppress(Exception):
                podman("rm", "--force", "--time=10", name, check=False, timeout=60)
