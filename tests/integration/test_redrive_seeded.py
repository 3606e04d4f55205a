"""`mars replay run --strict` with a stochastic routing policy (Thompson sampling) and MARS_ROUTER_ROUTING_SEED:
the same log, configuration and seed give identical decisions, the claim of the replay docs (item 7)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ingress_stub, keys_env, start_stack
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

TENANT, USER, TURNS = "sd", "seeded", 5
ROUTER_ENV = {"MARS_ROUTER_ROUTING_POLICY": "thompson", "MARS_ROUTER_ROUTING_SEED": "11"}


def _version(router: svc_grpc.RouterStub, tenant: str) -> int:
    return int(router.GetPolicy(svc.PolicyRequest(tenant=tenant, user_id=USER), timeout=10).version)


@pytest.fixture(scope="module")
def seeded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("seeded"),
        "models.standin-test.yaml",  # the stand-in LLM: no test here reads the answers' words
        llm="standin",
        service_env={"router": ROUTER_ENV, "dispatch": {"MARS_DISPATCH_DEFAULT_MAX_TOKENS": "8"}},
    )
    try:
        ingress = ingress_stub(s, TENANT)
        router = svc_grpc.RouterStub(s.channel("router"))
        for i in range(TURNS):
            before = _version(router, TENANT)
            ingress.SendTurn(
                svc.TurnRequest(tenant=TENANT, user_id=USER, session_id="s", text=f"Tea question {i}?"),
                timeout=180,
            )
            # Recorded as strictly as the re-drives: each reward in the policy before the next turn.
            deadline = time.monotonic() + 60
            while _version(router, TENANT) <= before:
                assert time.monotonic() < deadline, "the reward never reached the router"
                time.sleep(0.05)
        yield s
    finally:
        s.stop()


def mars(*args: str, stack: LocalStack | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI; with `stack`, able to open that stack's sealed event text (keys_env) and to read the router's
    policy as the replay tool (its service identity)."""
    exe = str(Path(sys.executable).parent / "mars")
    env = {**keys_env(stack), **stack.identity_env("replay")} if stack is not None else None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600, check=False, env=env)


# One recorded run and two strict re-drives of it: three times the turns of one run.
@pytest.mark.timeout(1200)
def test_two_strict_redrives_of_a_thompson_log_decide_identically(
    seeded_stack: LocalStack, tmp_path: Path
) -> None:
    log = tmp_path / "log.jsonl"
    run = mars(
        "replay", "export", "--bootstrap", seeded_stack.env["MARS_KAFKA_BOOTSTRAP"],
        "--out", str(log), stack=seeded_stack,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    runs = []
    for suffix in ("-a", "-b"):
        out = tmp_path / f"run{suffix}.jsonl"
        run = mars(
            "replay", "run", "--file", str(log), "--ingress", seeded_stack.addr("ingress"),
            "--router", seeded_stack.addr("router"), "--strict", f"--tenant-suffix={suffix}",
            "--postgres-dsn", seeded_stack.env["MARS_POSTGRES_DSN"],
            "--out", str(out),
        stack=seeded_stack,
    )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        summary = json.loads(run.stderr[run.stderr.index("{") :])
        assert summary["answered"] == TURNS
        runs.append([json.loads(line) for line in out.read_text().splitlines()])
        assert all("reward_wait" not in r for r in runs[-1])
    a, b = runs
    decisions = [r["arm"] for r in a]
    # Thompson sampling really drew: more than one arm was chosen over the turns...
    assert len(set(decisions)) > 1, decisions
    # ...and yet both re-drives made the same decisions, and the same as the recorded run (same seed).
    assert decisions == [r["arm"] for r in b]
    assert decisions == [r["recorded_arm"] for r in a]
    assert [r["text"] for r in a] == [r["text"] for r in b]
