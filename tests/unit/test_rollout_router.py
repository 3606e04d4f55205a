"""The router's side of canary runs that needs no Postgres (the rest: tests/integration/
test_policy_canary_pg.py and test_policy_canary_stack.py): its settings as the test's configuration, the
evidence made JSON-safe, the decision event, the control topic's forget readers skipping it, and the CLI's
refusals."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest
from mars.bus.consumer import forgets_only
from mars.domain.rollout import RolloutConfig, RolloutState, decide
from mars.v1 import events_pb2 as ev
from mars_router.rollouts import decision_event, finite
from mars_router.settings import RouterSettings
from mars_tools.cli import build_parser
from pydantic import ValidationError


def test_rollout_settings_are_the_tests_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "SHARE": "0.2",
        "ALPHA": "0.01",
        "CAP": "500",
        "WARMUP": "20",
        "EXPECTED_EFFECT": "0.1",
        "REWARD_SD": "0.3",
        "GUARDRAIL_ALPHA": "0.02",
        "MAX_FAILURE_EXCESS": "0.05",
        "MAX_COST_RATIO": "2",
        "MIN_UTILITY": "-1",
    }.items():
        monkeypatch.setenv(f"MARS_ROUTER_ROLLOUT_{name}", value)
    assert RouterSettings().rollout_config() == RolloutConfig(
        alpha=0.01,
        canary_share=0.2,
        max_turns=500,
        warmup_turns=20,
        expected_effect=0.1,
        reward_sd=0.3,
        guardrail_alpha=0.02,
        max_failure_excess=0.05,
        max_cost_ratio=2.0,
        min_utility=None,  # negative: the utility guardrail is off
    )
    assert RouterSettings(rollout_min_utility=0.4).rollout_config().min_utility == 0.4


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"rollout_cap": 100, "rollout_warmup": 100}, re.escape("max_turns >= 2 * warmup_turns")),
        ({"rollout_share": 1.0}, "rollout_share"),
        ({"rollout_alpha": 0.0}, "rollout_alpha"),
    ],
)
def test_a_bad_rollout_setting_is_refused_with_its_reason(values: dict[str, float], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterSettings(**values)  # type: ignore[arg-type]


def test_the_decision_event_carries_the_evidence_as_json() -> None:
    config = RolloutConfig(warmup_turns=2, max_turns=100)
    evidence = decide(RolloutState(), config).to_dict()
    assert math.isinf(evidence["cs_low"])  # no turn yet: the CS is the whole line
    event = decision_event(7, "acme", "v1", "v2", evidence, None)
    assert (event.tenant, event.live_version, event.candidate_version, event.rollout_id) == (
        "acme",
        "v1",
        "v2",
        7,
    )
    assert (event.decision, event.rule, event.turns_candidate) == ("continue", "warm-up", 0)
    loaded = json.loads(event.evidence_json)  # strict JSON: no Infinity
    assert loaded["cs_low"] is None and loaded["cs_high"] is None and loaded["alpha"] == 0.05
    assert finite({"a": math.nan, "b": {"c": -math.inf}, "d": 1.0}) == {"a": None, "b": {"c": None}, "d": 1.0}


def test_forget_readers_of_the_control_topic_skip_a_policy_decision() -> None:
    seen: list[ev.UserForgotten] = []

    async def on_forgotten(event: ev.UserForgotten) -> None:
        seen.append(event)

    handler = forgets_only(on_forgotten)
    decision = ev.PolicyDecision(tenant="acme", live_version="v1", candidate_version="v2", decision="promote")
    as_forget = ev.UserForgotten.FromString(decision.SerializeToString())
    assert not as_forget.user_id and not as_forget.tenant  # its fields are all unknown to UserForgotten
    forget = ev.UserForgotten(forget_id="f1", tenant="acme", user_id="bob")

    async def deliver() -> None:
        await handler(as_forget)
        await handler(forget)

    asyncio.run(deliver())
    assert seen == [forget]


def test_the_canary_command_wants_a_version_or_stop(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv in (["policy", "canary", "acme"], ["policy", "canary", "acme", "v2", "--stop"]):
        args = parser.parse_args(argv)
        assert args.func(args) == 2
    assert "give a VERSION to start a canary run, --stop to stop it, or --status" in capsys.readouterr().out
