"""The rubric judge's validation and fallbacks with an in-process fake endpoint (pure logic); the real
llama.cpp judge is exercised in tests/integration/test_llamacpp_stages.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from mars.domain.reward import PROFILES
from mars.llm_json import EndpointError, JsonReply, TokenPrices
from mars.v1 import events_pb2 as ev
from mars_judge.rubric.judge import FLAG_FIELDS, SCORE_FIELDS, RubricJudge, rubric_json_schema

TOP = {name: 5 for name in SCORE_FIELDS}
NO_FLAGS = {name: False for name in FLAG_FIELDS}


class FakeClient:
    dialect = "openai"

    def __init__(self, text: str = "", fail: bool = False, delay_s: float = 0.0) -> None:
        self.text, self.fail, self.delay_s, self.calls = text, fail, delay_s, 0

    async def complete(self, messages: list[dict[str, str]], schema: dict[str, Any], name: str) -> JsonReply:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise EndpointError("connection refused")
        assert "CANDIDATE ANSWER" in messages[1]["content"] and name == "turn_judgement"
        return JsonReply(self.text, 1000, 100, usage_estimated=False)

    async def aclose(self) -> None:
        return None


def generated(
    answer: str = "Day 1: Alfama walk. Day 2: Belem and the tram.", phase: int = ev.EXPLORE
) -> ev.Generated:
    g = ev.Generated(status=ev.OK, query="Plan my Lisbon days", text=answer, cost_usd=0.01, model="m")
    g.state.phase = phase  # type: ignore[assignment]
    g.state.taxonomy.need_memory = 1
    g.packed_blocks.add(block_id="b1", text="User wants a calm Lisbon trip: Alfama, Belem, tram 28.")
    return g


def judge(client: FakeClient | None, profile: str = "realmem", deadline_s: float = 5.0) -> RubricJudge:
    return RubricJudge(client, profile, deadline_s=deadline_s, pricing=TokenPrices(0.15, 0.60))  # type: ignore[arg-type]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_schema_is_the_proto_rubric() -> None:
    schema = rubric_json_schema()
    assert set(schema["properties"]["scores"]["required"]) == set(SCORE_FIELDS) and len(SCORE_FIELDS) == 6
    assert set(schema["properties"]["flags"]["required"]) == set(FLAG_FIELDS) and len(FLAG_FIELDS) == 4


def test_valid_judgement_gives_eq17_by_hand_and_judge_cost() -> None:
    text = json.dumps({"scores": TOP, "flags": NO_FLAGS, "confidence": 0.8})
    j = run(judge(FakeClient(text)).score(generated(), lambda_cost=0.5))
    c = j.coverage
    m = (c + 1.0 + 1.0) / 3.0
    assert j.memory_component == pytest.approx(m)
    assert (j.answer_component, j.quality_component, j.penalty) == (1.0, 1.0, 0.0)
    assert j.utility == pytest.approx(min(1.0, 0.45 * m + 0.40 + 0.15))
    assert j.reward == pytest.approx(j.utility - 0.5 * 0.01)
    assert j.judge_cost_usd == pytest.approx((1000 * 0.15 + 100 * 0.60) / 1e6)
    assert j.judge == "rubric-judge-v1:openai" and j.judge_confidence == 0.8 and not j.judge_fallback_reason


@pytest.mark.parametrize(("profile", "penalty"), [("realmem", 0.06), ("multichallenge", 0.12)])
def test_profiles_set_the_penalties(profile: str, penalty: float) -> None:
    text = json.dumps({"scores": TOP, "flags": dict(NO_FLAGS, restart=True), "confidence": 1})
    j = run(judge(FakeClient(text), profile).score(generated(), 0.0))
    assert j.penalty == pytest.approx(penalty) == pytest.approx(PROFILES[profile].restart)


def test_profiles_compose_m_from_the_llm_scores() -> None:
    """B.5: MultiChallenge's M averages in the judge's revision application, with coverage as 1."""
    text = json.dumps({"scores": dict(TOP, revision_application=1), "flags": NO_FLAGS, "confidence": 1})
    mc = run(judge(FakeClient(text), "multichallenge").score(generated(phase=ev.REVISE), 0.0))
    assert mc.memory_component == pytest.approx((1.0 + 1.0 + 1.0 + 0.2) / 4)
    assert mc.utility == pytest.approx(0.45 * 0.8 + 0.40 + 0.15)
    rm = run(judge(FakeClient(text), "realmem").score(generated(phase=ev.REVISE), 0.0))
    assert 0.0 < rm.coverage < 1.0 and rm.coverage == pytest.approx(mc.coverage)
    assert rm.memory_component == pytest.approx((rm.coverage + 1.0 + 1.0) / 3)


def test_bad_fields_are_repaired_from_the_deterministic_judge() -> None:
    deterministic = run(judge(None).score(generated(), 0.0))
    scores = dict(TOP, answer_helpfulness=9)
    del scores["state_alignment"]
    text = json.dumps({"scores": scores, "flags": dict(NO_FLAGS, topic_drift="yes"), "confidence": 7})
    rj = judge(FakeClient(text))
    j = run(rj.score(generated(), 0.0))
    assert j.rubric.answer_helpfulness == 5.0  # clamped
    assert j.rubric.state_alignment == pytest.approx(deterministic.rubric.state_alignment)  # kept
    assert j.flags.topic_drift == deterministic.flags.topic_drift and j.judge_confidence == 1.0
    assert rj.counts["repaired"] == 1 and 0.0 <= j.utility <= 1.0


def test_unparseable_output_falls_back_but_keeps_the_judge_cost() -> None:
    rj = judge(FakeClient("The answer looks fine to me."))
    j = run(rj.score(generated(), 0.0))
    assert j.judge == "deterministic-v1" and j.judge_fallback_reason == "parse_error"
    assert j.judge_cost_usd > 0 and rj.counts["parse_error"] == 1


@pytest.mark.parametrize(
    ("client", "reason"),
    [(FakeClient(fail=True), "endpoint_error"), (FakeClient("{}", delay_s=1), "deadline")],
)
def test_judge_down_or_late_gives_the_deterministic_judgement(client: FakeClient, reason: str) -> None:
    rj = judge(client, deadline_s=0.05)
    j = run(rj.score(generated(), 0.5))
    deterministic = run(judge(None).score(generated(), 0.5))
    assert j.judge_fallback_reason == reason and j.judge == "deterministic-v1"
    assert j.reward == pytest.approx(deterministic.reward) and j.judge_cost_usd == 0.0


def test_empty_answer_is_not_sent_to_the_judge() -> None:
    client = FakeClient(json.dumps({"scores": TOP, "flags": NO_FLAGS, "confidence": 1}))
    j = run(judge(client).score(generated(answer="  "), 0.5))
    assert client.calls == 0 and j.utility == 0.0 and j.reward == pytest.approx(-0.5 * 0.01)


def test_unknown_profile_or_prompt_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown judge profile"):
        RubricJudge(None, "mmlu")
    with pytest.raises(ValueError, match="unknown judge prompt"):
        RubricJudge(None, prompt="judge-v9")
