"""`replay run --strict` waits for each turn's reward to reach the policy (its version moves); a frozen
router (MARS_ROUTER_POLICY_UPDATES=false, the no-online-update preset) never moves its version and takes no reward
in, so strict mode goes straight on instead of timing out on every turn."""

from __future__ import annotations

import time
from typing import Any

import pytest
from mars.v1 import services_pb2 as svc
from mars_tools.replay import redrive as rd

TURNS = [rd.RecordedTurn(f"rec-{i}", "t", "u", "s", i, f"turn {i}", {}, "small", "small") for i in range(3)]


class FakeRouter:
    def __init__(self, frozen: bool) -> None:
        self.frozen = frozen
        self.version = 0
        self.calls = 0

    def GetPolicy(self, request: svc.PolicyRequest, timeout: float) -> svc.PolicyInfo:
        self.calls += 1
        return svc.PolicyInfo(policy_id="user:t/u", version=self.version, frozen=self.frozen)


def _run(monkeypatch: pytest.MonkeyPatch, router: FakeRouter) -> tuple[list[dict[str, Any]], float]:
    class FakeIngress:
        def __init__(self, channel: object) -> None:
            pass

        def SendTurn(self, request: svc.TurnRequest, timeout: float) -> svc.TurnReply:
            if not router.frozen:
                router.version += 1  # a learning router: the reward lands by the time we ask
            return svc.TurnReply(turn_id=f"new-{request.text}", model="small", text="ok")

    monkeypatch.setattr(rd.svc_grpc, "IngressStub", FakeIngress)
    monkeypatch.setattr(rd.svc_grpc, "RouterStub", lambda channel: router)
    started = time.monotonic()
    rows = rd.redrive(TURNS, "127.0.0.1:1", "-x", "127.0.0.1:2", reward_timeout_s=2.0)
    return rows, time.monotonic() - started


def test_strict_mode_does_not_wait_on_a_frozen_router(monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter(frozen=True)
    rows, took = _run(monkeypatch, router)
    assert len(rows) == 3 and all("reward_wait" not in r and r["answered_by"] == "small" for r in rows)
    assert took < 1.0 and router.calls == 3  # one look per turn (it says frozen), no polling


def test_strict_mode_waits_for_a_learning_router_version(monkeypatch: pytest.MonkeyPatch) -> None:
    router = FakeRouter(frozen=False)
    rows, _ = _run(monkeypatch, router)
    assert len(rows) == 3 and all("reward_wait" not in r for r in rows)
    assert router.calls == 6  # before each turn and once after it, when the version has moved
