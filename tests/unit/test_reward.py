import pytest
from mars.domain.reward import compose_utility, judge_turn
from mars.domain.state_rules import clamp_state
from mars.v1 import events_pb2 as ev


def _state(phase: str = "EXPLORE", need: int = 1, action: str = "MATCH") -> ev.SessionState:
    return clamp_state(
        {
            "action": action,
            "query_type": "DYNAMIC",
            "phase": phase,
            "taxonomy": {"need_memory": need, "memory_span": "ACTIVE_THREAD", "ambiguity": "LOW"},
            "lens_recommendation": 3,
            "top_k_hint": 5,
            "prefer_recent": 0,
            "retrieval_scope": "LOCAL",
            "lens_confidence": 0.8,
            "lens_reason": "r",
        }
    )


MEMORY = [
    ev.MemoryBlock(
        block_id="active",
        kind=ev.ACTIVE_STATE,
        text="Trip to Lisbon in May, budget 1500 euros, hotel in Alfama, two museums.",
    )
]


def test_eq17_arithmetic() -> None:
    rubric = ev.RubricScores(
        answer_helpfulness=4,
        state_alignment=3,
        routing_adequacy=5,
        intermediate_product=2,
        final_integration=4,
    )
    flags = ev.FailureFlags(restart=True)
    m, a, q, p, u = compose_utility(rubric, flags, coverage=0.5, final_step=False)
    assert m == pytest.approx((0.5 + 0.6 + 1.0) / 3)
    assert a == pytest.approx((0.8 + 0.6 + 1.0) / 3)
    assert q == pytest.approx(0.4)
    assert p == pytest.approx(0.06)
    assert u == pytest.approx(0.45 * m + 0.40 * a + 0.15 * q - 0.06)
    _, _, q_final, _, _ = compose_utility(rubric, flags, 0.5, final_step=True)
    assert q_final == pytest.approx(0.6)


def test_penalties_and_clip() -> None:
    zero = ev.RubricScores()
    all_flags = ev.FailureFlags(
        topic_drift=True, restart=True, hallucination=True, severe_missing_history=True
    )
    *_, p, u = compose_utility(zero, all_flags, 0.0, False)
    assert p == pytest.approx(0.40)
    assert u == 0.0
    top = ev.RubricScores(
        answer_helpfulness=5,
        state_alignment=5,
        routing_adequacy=5,
        intermediate_product=5,
        final_integration=5,
    )
    *_, u_top = compose_utility(top, ev.FailureFlags(), 1.0, True)
    assert u_top == pytest.approx(1.0)
    assert u_top <= 1.0


@pytest.mark.parametrize("answer", ["", "   \n "])
def test_empty_answer_gives_zero_utility(answer: str) -> None:
    j = judge_turn("plan my Lisbon trip", answer, MEMORY, _state(), gen_cost_usd=0.01, lambda_cost=0.5)
    assert j.utility == 0.0
    assert j.reward == pytest.approx(-0.005)
    assert j.judge == "deterministic-v1"


def test_grounded_answer_scores_well_and_cost_is_subtracted() -> None:
    answer = "For your Lisbon trip in May with a 1500 euros budget, stay in Alfama and pick two museums."
    j = judge_turn("Plan the Lisbon trip days", answer, MEMORY, _state(), gen_cost_usd=0.02, lambda_cost=0.5)
    assert 0.5 < j.utility <= 1.0
    assert j.reward == pytest.approx(j.utility - 0.01)
    assert j.cost_usd == 0.02 and j.lambda_cost == 0.5
    assert not any(
        [j.flags.topic_drift, j.flags.restart, j.flags.hallucination, j.flags.severe_missing_history]
    )
    for v in (j.rubric.answer_helpfulness, j.rubric.state_alignment, j.rubric.routing_adequacy):
        assert 0.0 <= v <= 5.0
    expected = 0.45 * j.memory_component + 0.40 * j.answer_component + 0.15 * j.quality_component - j.penalty
    assert j.utility == pytest.approx(min(1.0, max(0.0, expected)))


def test_grounded_beats_ungrounded_answer() -> None:
    good = judge_turn(
        "Plan the Lisbon trip",
        "Lisbon in May: Alfama hotel, two museums, 1500 euros budget.",
        MEMORY,
        _state(),
        0.0,
        0.0,
    )
    bad = judge_turn(
        "Plan the Lisbon trip",
        "Quantum chromodynamics describes gluons binding quarks.",
        MEMORY,
        _state(),
        0.0,
        0.0,
    )
    assert good.utility > bad.utility
    assert bad.flags.topic_drift
    assert bad.penalty >= 0.10


def test_restart_flag_on_revision_ignoring_memory() -> None:
    j = judge_turn(
        "shorten it",
        "Here is a brand new unrelated poem about oceans.",
        MEMORY,
        _state(phase="REVISE"),
        0.0,
        0.0,
    )
    assert j.flags.restart
    ok = judge_turn(
        "shorten it", "Lisbon, May, Alfama hotel, 1500 euros.", MEMORY, _state(phase="REVISE"), 0.0, 0.0
    )
    assert not ok.flags.restart


def test_missing_history_flag_and_no_memory_needed() -> None:
    j = judge_turn("continue the plan", "Sure, here is the next step of the plan.", [], _state(), 0.0, 0.0)
    assert j.flags.severe_missing_history
    free = judge_turn("what is 2+2", "2+2 equals 4.", [], _state(need=0, action="NEW_TOPIC"), 0.0, 0.0)
    assert not free.flags.severe_missing_history
    assert free.rubric.state_alignment == 4.0
    assert free.utility > 0.0


def test_large_cost_can_make_reward_negative() -> None:
    j = judge_turn("Plan the Lisbon trip", "Lisbon: Alfama, two museums.", MEMORY, _state(), 5.0, 0.5)
    assert j.reward == pytest.approx(j.utility - 2.5)
    assert j.reward < 0
