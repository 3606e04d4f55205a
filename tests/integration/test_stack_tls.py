"""The local stack with mutual TLS (`StackSettings(tls=True)`, `mars stack --tls`): a local CA in the work
directory, every service's gRPC port refusing plaintext and certificate-less callers, health in plaintext on
each process's own port (what the launcher's readiness checks use), turns over mutual TLS, and `mars send`
configured by stack.env alone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import REPO, STACK_ENV, api_key
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars import tls, topology
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack, StackSettings
from mars_stack.credentials import CALLER_TLS_VARS

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    settings = StackSettings(
        workdir=tmp_path_factory.mktemp("tls") / "stack",
        model_pool=REPO / "config" / "models.standin.yaml",
        llm="standin",
        extra_env=dict(STACK_ENV),
        tls=True,
    )
    s = LocalStack(settings).start()
    try:
        yield s
    finally:
        s.stop()


def _health(target: str, client_tls: tls.ClientTls, service: str = "") -> int:
    with tls.channel(target, client_tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.RpcError:
            return int(health_pb2.HealthCheckResponse.UNKNOWN)
        return int(reply.status)


def test_every_service_serves_mutual_tls_only(tls_stack: LocalStack) -> None:
    env = tls_stack.env
    caller = tls.ClientTls(
        env["MARS_TLS_CA_FILE"], env["MARS_TLS_CLIENT_CERT_FILE"], env["MARS_TLS_CLIENT_KEY_FILE"]
    )
    assert Path(env["MARS_TLS_CA_FILE"]).parent == Path(tls_stack.workdir) / "tls"
    for name, service in tls_stack.service_procs():
        target = f"127.0.0.1:{tls_stack.ports[name]}"
        assert _health(target, caller, topology.service(service).grpc_service) == SERVING, name
        assert _health(target, tls.ClientTls()) != SERVING, f"{name} answers plaintext"
        assert _health(target, tls.ClientTls(ca_file=env["MARS_TLS_CA_FILE"])) != SERVING, f"{name}: no cert"
        # Health alone, in plaintext, on the process's own port (for probes and the launcher).
        health_only = f"127.0.0.1:{tls_stack.health_port(name)}"
        assert tls_stack.health_port(name) != tls_stack.ports[name]
        assert _health(health_only, tls.ClientTls(), topology.service(service).grpc_service) == SERVING, name
    # stack.env tells callers where the CA and their certificate are.
    lines = (Path(tls_stack.workdir) / "stack.env").read_text().splitlines()
    assert all(any(line.startswith(f"{var}=") for line in lines) for var in CALLER_TLS_VARS)


def test_turns_go_over_mutual_tls(tls_stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    key = api_key(tls_stack, "tls")
    with grpc.insecure_channel(tls_stack.addr("ingress")) as plain:
        with pytest.raises(grpc.RpcError) as refused:
            svc_grpc.IngressStub(plain).SendTurn(svc.TurnRequest(user_id="u1", text="plaintext?"), timeout=20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    for var in CALLER_TLS_VARS:
        monkeypatch.setenv(var, tls_stack.env[var])
    with ingress_channel(tls_stack.addr("ingress"), key) as channel:
        reply = svc_grpc.IngressStub(channel).SendTurn(
            svc.TurnRequest(user_id="u1", session_id="s", text="Hello over mutual TLS"), timeout=120
        )
    assert reply.text and reply.seq == 1
    # `mars send` with nothing but the stack's stack.env in its environment (tenant, key, certificates).
    env = {k: v for k, v in os.environ.items() if not k.startswith("MARS_")}
    env.update({k: v for k, v in tls_stack.env.items() if k.startswith("MARS_")})
    run = subprocess.run(
        [str(Path(sys.executable).parent / "mars"), "send", "--target", tls_stack.addr("ingress"),
         "--user", "u2", "--timeout", "120", "And once more from the CLI"],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "standin-" in run.stdout
