"""The guarded QTM step: schema, prompt templates, output parsing, and every fallback rule.

Controllers here are in-process fakes (pure logic); the real llama.cpp server is exercised in
tests/integration/test_llamacpp_stages.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from mars.domain.state_rules import estimate_state
from mars.llm_json import TokenPrices
from mars.v1 import events_pb2 as ev
from mars_state.qtm.controllers import ControllerReply, ControllerUnavailable, make_controller
from mars_state.qtm.guard import UNHEALTHY_AFTER, GuardedEstimator
from mars_state.qtm.prompts import PromptTemplate, available_prompts
from mars_state.qtm.schema import ControllerOutputError, parse_controller_output, qtm_json_schema

#: The anonymised example output of the paper (appendix B.1), shared with the other QTM tests.
PAPER_EXAMPLE = json.loads((Path(__file__).parent / "fixtures" / "qtm_paper_example.json").read_text())


class FakeController:
    """Answers with a fixed text after `delay_s`, or raises ControllerUnavailable when `fail`."""

    def __init__(self, text: str = "", delay_s: float = 0.0, fail: bool = False, usage: bool = True) -> None:
        self.name = "openai"
        self.prompt_version = "qtm-v1"
        self.text, self.delay_s, self.fail, self.usage = text, delay_s, fail, usage
        self.calls = 0

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ControllerUnavailable("connection refused")
        return ControllerReply(self.text, 700, 120, usage_estimated=not self.usage)

    async def aclose(self) -> None:
        return None


# ---- schema and parsing -----------------------------------------------------------------------------


def test_schema_enums_are_the_proto_enums_without_unspecified() -> None:
    props = qtm_json_schema()["properties"]
    assert props["action"]["enum"] == ["MATCH", "NEW_TOPIC"]
    assert props["phase"]["enum"] == ["EXPLORE", "CONSTRAIN", "REVISE", "SYNTHESIZE", "VERIFY"]
    assert props["taxonomy"]["properties"]["memory_span"]["enum"] == [
        "NONE",
        "ACTIVE_THREAD",
        "CROSS_SESSION",
    ]
    assert props["top_k_hint"]["enum"] == [3, 5, 8] and props["lens_recommendation"]["enum"] == [0, 3]
    # Every Table 5 field a controller must fill is required.
    assert set(qtm_json_schema()["required"]) == set(PAPER_EXAMPLE)


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(PAPER_EXAMPLE),
        "```json\n" + json.dumps(PAPER_EXAMPLE) + "\n```",
        "Here is the state: " + json.dumps(PAPER_EXAMPLE) + " Hope this helps.",
        "{not json} then " + json.dumps(PAPER_EXAMPLE),
    ],
)
def test_parser_finds_the_object(text: str) -> None:
    assert parse_controller_output(text) == PAPER_EXAMPLE


@pytest.mark.parametrize("text", ["", "MATCH, REVISE", "[1, 2, 3]", '{"action": "MATCH"'])
def test_parser_rejects_text_without_an_object(text: str) -> None:
    with pytest.raises(ControllerOutputError):
        parse_controller_output(text)


# ---- prompts ------------------------------------------------------------------------------------------


def test_three_prompt_versions_render_all_blocks() -> None:
    assert {"qtm-v1", "qtm-v1-reordered", "qtm-v1-paraphrased"} <= set(available_prompts())
    for version in ("qtm-v1", "qtm-v1-reordered", "qtm-v1-paraphrased"):
        t = PromptTemplate.load(version)
        out = t.render("make the intro shorter", ["write a cover letter for a museum job"])
        assert t.version == version
        assert "make the intro shorter" in out and "1. write a cover letter" in out
        assert "NEW_TOPIC" in out and "{{" not in out  # system rules inlined, no placeholder left


def test_prompt_without_context_says_so_and_clips_long_turns() -> None:
    t = PromptTemplate.load()
    assert "(none: no active thread)" in t.render("hello", [" ", ""])
    assert len(t.render("q", ["x" * 5000])) < len(t.text) + len(t.rules) + 1000


def test_unknown_prompt_and_backend_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown QTM prompt"):
        PromptTemplate.load("qtm-v9")
    with pytest.raises(ValueError, match="unknown QTM backend"):
        make_controller("gpt")
    with pytest.raises(ValueError, match="needs an endpoint"):
        make_controller("openai")
    assert make_controller("rules") is None


# ---- the guard ------------------------------------------------------------------------------------------


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_valid_answer_is_used_with_usage_and_cost() -> None:
    guard = GuardedEstimator(FakeController(json.dumps(PAPER_EXAMPLE)), pricing=TokenPrices(0.04, 0.10))
    st = run(guard.estimate("make it shorter", ["write a poem"]))
    assert st.phase == ev.REVISE and not st.clamped_fields and not st.usage.fallback_reason
    assert st.usage.backend == "openai" and st.usage.llm_called and st.usage.prompt_version == "qtm-v1"
    assert (st.usage.input_tokens, st.usage.output_tokens) == (700, 120)
    assert st.usage.cost_usd == pytest.approx((700 * 0.04 + 120 * 0.10) / 1e6)
    assert guard.counts["ok"] == 1


def test_invalid_fields_are_clamped_and_counted() -> None:
    bad = dict(PAPER_EXAMPLE, top_k_hint=7, phase="BRAINSTORM")
    guard = GuardedEstimator(FakeController(json.dumps(bad)))
    st = run(guard.estimate("go on", ["write a poem"]))
    assert st.top_k_hint == 8 and st.phase == ev.EXPLORE
    assert {"top_k_hint", "phase"} <= set(st.clamped_fields) and guard.counts["clamped"] == 1


def test_unparseable_output_gives_conservative_state_and_keeps_cost() -> None:
    guard = GuardedEstimator(FakeController("I think this continues the thread."))
    st = run(guard.estimate("and the second verse?", ["write a poem"]))
    assert st.usage.fallback_reason == "parse_error" and guard.counts["parse_error"] == 1
    assert st.action == ev.MATCH and st.taxonomy.need_memory == 1 and st.lens_recommendation == 3
    assert st.usage.cost_usd > 0  # the tokens were spent even though the answer was unusable


def test_deadline_falls_back_to_rules() -> None:
    guard = GuardedEstimator(FakeController(json.dumps(PAPER_EXAMPLE), delay_s=1.0), deadline_s=0.05)
    st = run(guard.estimate("When did I book the Lisbon flight?", []))
    rules = estimate_state("When did I book the Lisbon flight?", [])
    assert st.usage.fallback_reason == "deadline" and st.usage.backend == "rules"
    assert st.query_type == rules.query_type == ev.TEMPORAL
    assert st.usage.latency_ms < 900 and guard.counts["deadline"] == 1


def test_endpoint_down_falls_back_and_reports_unhealthy_until_recovery() -> None:
    controller = FakeController(json.dumps(PAPER_EXAMPLE), fail=True)
    guard = GuardedEstimator(controller)
    for i in range(UNHEALTHY_AFTER):
        assert guard.healthy
        st = run(guard.estimate(f"turn {i}", []))
        assert st.usage.fallback_reason == "endpoint_error" and st.lens_reason
    assert not guard.healthy and guard.counts["endpoint_error"] == UNHEALTHY_AFTER
    controller.fail = False
    run(guard.estimate("back again", []))
    assert guard.healthy


def test_revision_turn_split_off_by_the_controller_is_mapped_back_to_match() -> None:
    split = dict(
        PAPER_EXAMPLE,
        action="NEW_TOPIC",
        phase="EXPLORE",
        lens_recommendation=0,
        taxonomy={"need_memory": 0, "memory_span": "NONE", "ambiguity": "LOW"},
    )
    guard = GuardedEstimator(FakeController(json.dumps(split)))
    st = run(guard.estimate("Revise the cover letter to sound warmer", ["write a cover letter"]))
    assert st.action == ev.MATCH and st.taxonomy.need_memory == 1 and st.lens_recommendation == 3
    assert st.taxonomy.memory_span == ev.ACTIVE_THREAD and "action" in st.clamped_fields
    assert guard.counts["revision_guard"] == 1
    # Without an active thread there is nothing to continue: the controller's split stands.
    st = run(guard.estimate("Revise the cover letter to sound warmer", []))
    assert st.action == ev.NEW_TOPIC


def test_missing_usage_is_marked_estimated() -> None:
    guard = GuardedEstimator(FakeController(json.dumps(PAPER_EXAMPLE), usage=False))
    assert run(guard.estimate("go on", ["x"])).usage.usage_estimated


def test_rules_backend_needs_no_controller() -> None:
    guard = GuardedEstimator(None)
    st = run(guard.estimate("summarize the final plan", []))
    assert st.usage.backend == "rules" and not st.usage.llm_called and guard.counts["rules"] == 1


@settings(max_examples=300, deadline=None)
@given(
    text=hs.text(min_size=0, max_size=400),
    ctx=hs.lists(hs.text(max_size=200), max_size=6),
    answer=hs.one_of(
        hs.text(max_size=200),
        hs.dictionaries(
            hs.sampled_from([*PAPER_EXAMPLE, "extra"]),
            hs.recursive(
                hs.none() | hs.booleans() | hs.integers() | hs.floats() | hs.text(max_size=20),
                lambda inner: (
                    hs.lists(inner, max_size=3) | hs.dictionaries(hs.text(max_size=12), inner, max_size=3)
                ),
                max_leaves=8,
            ),
        ).map(json.dumps),
    ),
)
def test_any_controller_output_yields_a_valid_state(text: str, ctx: list[str], answer: str) -> None:
    st = run(GuardedEstimator(FakeController(answer)).estimate(text, ctx))
    assert st.action in (ev.MATCH, ev.NEW_TOPIC)
    assert st.top_k_hint in (3, 5, 8) and st.lens_recommendation in (0, 3) and st.prefer_recent in (0, 1)
    assert st.retrieval_scope in (ev.LOCAL, ev.GLOBAL) and 0.0 <= st.lens_confidence <= 1.0
    assert st.lens_reason


@settings(max_examples=500, deadline=None)
@given(text=hs.text(max_size=2000), ctx=hs.lists(hs.text(max_size=500), max_size=8))
def test_rules_never_raise_on_any_input(text: str, ctx: list[str]) -> None:
    st = estimate_state(text, ctx)
    assert not st.clamped_fields and st.usage.backend == "rules"
