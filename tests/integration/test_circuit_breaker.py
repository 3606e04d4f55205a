"""Dispatch's per-arm circuit breaker against real endpoints: a dead endpoint's circuit opens after the
threshold (calls then fail fast, health and ListModels say so), and closes after the pause once a real
llama.cpp server answers the trial call on that port."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import pytest
from conftest import start_stack, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack
from mars_stack.readiness import free_port

pytestmark = pytest.mark.integration

FLAKY_PORT = free_port()
RESET_S = 3.0


@pytest.fixture(scope="module")
def dispatch_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    env = {
        "MARS_FLAKY_PORT": str(FLAKY_PORT),
        "MARS_DISPATCH_CIRCUIT_FAILURE_THRESHOLD": "2",
        "MARS_DISPATCH_CIRCUIT_RESET_S": str(RESET_S),
        "MARS_DISPATCH_RETRIES_PER_ARM": "0",
    }
    s = start_stack(
        tmp_path_factory.mktemp("circuit"),
        "models.flaky.yaml",
        services=("dispatch",),
        service_env={"dispatch": env},
    )
    try:
        yield s
    finally:
        s.stop()


def _arm_health(stack: LocalStack, arm: str) -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack.addr("dispatch")))
    return stub.Check(health_pb2.HealthCheckRequest(service=f"mars.v1.Dispatch.arm.{arm}"), timeout=5).status


def _circuit(stack: LocalStack, arm: str) -> str:
    stub = svc_grpc.DispatchStub(stack.channel("dispatch"))
    return {m.name: m.circuit for m in stub.ListModels(svc.Empty(), timeout=5).models}[arm]


def test_circuit_opens_on_a_dead_endpoint_and_closes_when_it_answers(dispatch_stack: LocalStack) -> None:
    stub = svc_grpc.DispatchStub(dispatch_stack.channel("dispatch"))

    def call() -> object:
        return stub.Generate(svc.GenerateRequest(arm="flaky", text="Say hello.", max_tokens=8), timeout=60)

    for _ in range(2):
        g = call()
        assert not g.attempts[0].ok and "circuit" not in g.attempts[0].error  # a real connection error
    assert _circuit(dispatch_stack, "flaky") == "open"
    fast = call()
    assert "circuit open for flaky" in fast.attempts[0].error and fast.attempts[0].latency_ms < 50
    wait_for(
        lambda: _arm_health(dispatch_stack, "flaky") == health_pb2.HealthCheckResponse.NOT_SERVING,
        10,
        "the flaky arm's health to turn NOT_SERVING",
    )
    assert _arm_health(dispatch_stack, "smollm2") == health_pb2.HealthCheckResponse.SERVING

    # The endpoint comes back: a real llama.cpp server on the flaky port.
    server = subprocess.Popen(
        [
            sys.executable, "-m", "llama_cpp.server", "--model", dispatch_stack.env["MARS_LOCAL_GGUF"],
            "--model_alias", "smollm2-135m-instruct", "--host", "127.0.0.1", "--port", str(FLAKY_PORT),
            "--n_ctx", "2048", "--n_threads", "1", "--verbose", "False",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(
            lambda: _ready(f"http://127.0.0.1:{FLAKY_PORT}/v1/models"), 120, "the second llama.cpp server"
        )
        wait_for(lambda: _circuit(dispatch_stack, "flaky") == "half_open", RESET_S + 10, "half-open")
        trial = call()
        assert trial.attempts[0].ok and trial.text and trial.model == "flaky"
        assert _circuit(dispatch_stack, "flaky") == "closed"
        wait_for(
            lambda: _arm_health(dispatch_stack, "flaky") == health_pb2.HealthCheckResponse.SERVING,
            10,
            "the flaky arm's health to recover",
        )
    finally:
        server.terminate()
        server.wait(timeout=15)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
