import json
from pathlib import Path

import pytest
from mars.domain.state_rules import clamp_state, estimate_state
from mars.v1 import events_pb2 as ev

#: The anonymised example output of the paper (appendix B.1), shared with the other QTM tests.
VALID = json.loads((Path(__file__).parent / "fixtures" / "qtm_paper_example.json").read_text())

CONTEXT = ["User: draft a cover letter for a data analyst job\nAssistant: Dear hiring manager, ..."]


def test_valid_paper_example_passes_unchanged() -> None:
    st = clamp_state(VALID)
    assert list(st.clamped_fields) == []
    assert st.action == ev.MATCH and st.phase == ev.REVISE and st.query_type == ev.DYNAMIC
    assert st.taxonomy.need_memory == 1 and st.taxonomy.ambiguity == ev.LOW
    assert (st.top_k_hint, st.prefer_recent, st.lens_recommendation) == (5, 1, 3)
    assert st.lens_confidence == pytest.approx(0.82)


def test_empty_dict_gets_conservative_defaults() -> None:
    st = clamp_state({})
    assert st.action == ev.MATCH
    assert st.query_type == ev.DYNAMIC
    assert st.phase == ev.EXPLORE
    assert st.taxonomy.need_memory == 1
    assert st.taxonomy.memory_span == ev.ACTIVE_THREAD
    assert st.taxonomy.ambiguity == ev.MEDIUM
    assert st.lens_recommendation == 3
    assert st.top_k_hint == 5
    assert st.prefer_recent == 0
    assert st.retrieval_scope == ev.LOCAL
    for name in ("action", "query_type", "phase", "taxonomy.need_memory", "top_k_hint", "lens_confidence"):
        assert name in st.clamped_fields


@pytest.mark.parametrize(("raw", "expected"), [(4, 5), (1, 3), (6, 5), (7, 8), (100, 8), ("x", 5), (None, 5)])
def test_top_k_maps_to_nearest_allowed(raw: object, expected: int) -> None:
    st = clamp_state({**VALID, "top_k_hint": raw})
    assert st.top_k_hint == expected
    assert "top_k_hint" in st.clamped_fields


def test_invalid_values_are_clamped_and_recorded() -> None:
    st = clamp_state(
        {
            **VALID,
            "query_type": "WEIRD",
            "lens_recommendation": 2,
            "prefer_recent": 7,
            "lens_confidence": 1.7,
            "retrieval_scope": "EVERYWHERE",
        }
    )
    assert st.query_type == ev.DYNAMIC
    assert st.lens_recommendation == 3
    assert st.prefer_recent == 0
    assert st.lens_confidence == 1.0
    assert st.retrieval_scope == ev.LOCAL
    assert set(st.clamped_fields) == {
        "query_type",
        "lens_recommendation",
        "prefer_recent",
        "lens_confidence",
        "retrieval_scope",
    }
    assert clamp_state({**VALID, "lens_confidence": -3}).lens_confidence == 0.0


def test_enum_names_are_case_insensitive() -> None:
    st = clamp_state({**VALID, "action": "new_topic", "phase": "explore"})
    assert st.action == ev.NEW_TOPIC and st.phase == ev.EXPLORE
    assert list(st.clamped_fields) == []


@pytest.mark.parametrize("phase", ["REVISE", "VERIFY"])
def test_guardrail_revision_new_topic_becomes_match(phase: str) -> None:
    raw = {
        **VALID,
        "phase": phase,
        "action": "NEW_TOPIC",
        "lens_recommendation": 0,
        "taxonomy": {"need_memory": 0, "memory_span": "NONE", "ambiguity": "LOW"},
    }
    st = clamp_state(raw)
    assert st.action == ev.MATCH
    assert st.taxonomy.need_memory == 1
    assert st.lens_recommendation == 3
    assert "action" in st.clamped_fields


def test_guardrail_not_applied_to_explore_topic_switch() -> None:
    st = clamp_state({**VALID, "phase": "EXPLORE", "action": "NEW_TOPIC"})
    assert st.action == ev.NEW_TOPIC
    assert "action" not in st.clamped_fields


def test_revision_turn_with_context() -> None:
    st = estimate_state("Make it shorter and change the tone", CONTEXT)
    assert st.action == ev.MATCH
    assert st.phase == ev.REVISE
    assert st.query_type == ev.DYNAMIC
    assert st.taxonomy.need_memory == 1
    assert st.retrieval_scope == ev.LOCAL
    assert st.prefer_recent == 1
    assert st.top_k_hint == 5
    assert st.lens_recommendation == 3
    assert "revision" in st.taxonomy.risk_flags
    assert st.taxonomy.ambiguity == ev.LOW
    assert st.usage.backend == "rules" and not st.usage.llm_called
    assert list(st.clamped_fields) == []


def test_self_contained_new_topic_needs_no_memory() -> None:
    st = estimate_state("Explain photosynthesis in plants for a biology class", [])
    assert st.action == ev.NEW_TOPIC
    assert st.query_type == ev.STATIC
    assert st.taxonomy.need_memory == 0
    assert st.taxonomy.memory_span == ev.NONE
    assert st.lens_recommendation == 0
    assert st.top_k_hint == 3
    assert st.retrieval_scope == ev.LOCAL


def test_unrelated_turn_with_context_is_new_topic() -> None:
    st = estimate_state("Explain photosynthesis in plants for a biology class", CONTEXT)
    assert st.action == ev.NEW_TOPIC


def test_lexical_overlap_alone_gives_match() -> None:
    st = estimate_state("cover letter data analyst job", CONTEXT)
    assert st.action == ev.MATCH
    assert st.query_type == ev.DYNAMIC


def test_temporal_turn_goes_global_with_large_k() -> None:
    st = estimate_state("What did we decide about the wedding venue last week?", [])
    assert st.query_type == ev.TEMPORAL
    assert st.taxonomy.need_memory == 1
    assert st.retrieval_scope == ev.GLOBAL
    assert st.taxonomy.memory_span == ev.CROSS_SESSION
    assert st.top_k_hint == 8
    assert st.prefer_recent == 1  # "last"
    assert "temporal" in st.taxonomy.risk_flags


def test_finalization_is_synthesize_with_k8() -> None:
    st = estimate_state("Please summarize everything into a final plan", CONTEXT)
    assert st.phase == ev.SYNTHESIZE
    assert st.top_k_hint == 8
    assert "finalization" in st.taxonomy.risk_flags


def test_phase_priority_revise_over_verify_over_constrain() -> None:
    assert estimate_state("check it and fix the intro", CONTEXT).phase == ev.REVISE
    assert estimate_state("can you verify that the dates are right", CONTEXT).phase == ev.VERIFY
    assert estimate_state("it must stay under one page", CONTEXT).phase == ev.CONSTRAIN


def test_proactive_and_quantity_cues() -> None:
    st = estimate_state("Can you suggest some ideas for a birthday party", [])
    assert st.query_type == ev.PROACTIVE
    q = estimate_state("how many calories are in a banana", [])
    assert "quantity" in q.taxonomy.risk_flags


def test_short_text_without_context_is_highly_ambiguous() -> None:
    assert estimate_state("hmm ok", []).taxonomy.ambiguity == ev.HIGH
    assert (
        estimate_state("Explain photosynthesis in plants for class", CONTEXT).taxonomy.ambiguity == ev.MEDIUM
    )


def test_revision_without_context_keeps_memory_and_valid_state() -> None:
    st = estimate_state("rewrite my resume summary", [])
    assert st.action == ev.NEW_TOPIC
    assert st.phase not in (ev.REVISE, ev.VERIFY)  # would contradict the guardrail
    assert st.taxonomy.need_memory == 1
    assert st.retrieval_scope == ev.GLOBAL
    assert list(st.clamped_fields) == []


@pytest.mark.parametrize(
    "text",
    [
        "",
        "?",
        "yes",
        "fix",
        "what was the total I spent before?",
        "double-check that is correct?",
        "wrap up the overall plan at most 200 words",
        "any recommendations for tomorrow",
    ],
)
@pytest.mark.parametrize("ctx", [[], CONTEXT])
def test_estimates_are_always_valid(text: str, ctx: list[str]) -> None:
    st = estimate_state(text, ctx)
    assert list(st.clamped_fields) == []
    assert 0.0 <= st.lens_confidence <= 1.0
    assert st.top_k_hint in (3, 5, 8)
    assert st.lens_recommendation == (0 if st.taxonomy.need_memory == 0 else 3)
    assert st.lens_reason
    assert st.thread_depth == 0
