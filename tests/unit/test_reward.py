import pytest
from mars.domain.reward import PROFILES, compose_utility, judge_turn, memory_coverage
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


# ---- Eq. 17 per profile (issue 12 item 3) -------------------------------------------------------------

RUBRIC = ev.RubricScores(
    answer_helpfulness=4,
    state_alignment=3,
    revision_application=2,
    routing_adequacy=5,
    intermediate_product=2,
    final_integration=4,
)


def test_realmem_memory_component_by_hand() -> None:
    m, a, q, p, u = compose_utility(RUBRIC, ev.FailureFlags(restart=True), 0.5, False, PROFILES["realmem"])
    assert m == pytest.approx((0.5 + 0.6 + 1.0) / 3)  # coverage, state alignment, routing adequacy
    assert (a, q, p) == (pytest.approx((0.8 + 0.6 + 1.0) / 3), pytest.approx(0.4), pytest.approx(0.06))
    assert u == pytest.approx(0.45 * 0.7 + 0.40 * 0.8 + 0.15 * 0.4 - 0.06)
    # Revision application is not part of RealMem's M.
    other = ev.RubricScores()
    other.CopyFrom(RUBRIC)
    other.revision_application = 5
    assert compose_utility(other, ev.FailureFlags(), 0.5, False)[0] == pytest.approx(m)


def test_multichallenge_memory_component_by_hand() -> None:
    """B.5: MultiChallenge's M additionally includes normalized revision application; coverage is 1."""
    mc = PROFILES["multichallenge"]
    m, a, q, p, u = compose_utility(RUBRIC, ev.FailureFlags(restart=True), 0.5, False, mc)
    assert m == pytest.approx((1.0 + 0.6 + 1.0 + 0.4) / 4) == pytest.approx(0.75)
    assert (a, q, p) == (pytest.approx(0.8), pytest.approx(0.4), pytest.approx(0.12))
    assert u == pytest.approx(0.45 * 0.75 + 0.40 * 0.8 + 0.15 * 0.4 - 0.12)
    # The measured coverage does not enter; revision application does.
    assert compose_utility(RUBRIC, ev.FailureFlags(), 0.0, False, mc)[0] == pytest.approx(0.75)
    better = ev.RubricScores()
    better.CopyFrom(RUBRIC)
    better.revision_application = 5
    assert compose_utility(better, ev.FailureFlags(), 0.0, False, mc)[0] == pytest.approx(0.9)


def test_judge_turn_composes_m_by_profile() -> None:
    query, answer = (
        "shorten the Lisbon plan",
        "Shorter plan: Lisbon, one calm day, walk slowly, eat pastries.",
    )
    for name in ("realmem", "multichallenge"):
        j = judge_turn(query, answer, MEMORY, _state(phase="REVISE"), 0.0, 0.0, PROFILES[name])
        r = j.rubric
        if name == "realmem":
            expected = (j.coverage + r.state_alignment / 5 + r.routing_adequacy / 5) / 3
        else:
            expected = (1.0 + r.state_alignment / 5 + r.routing_adequacy / 5 + r.revision_application / 5) / 4
        assert j.memory_component == pytest.approx(expected)
        assert r.revision_application < 5.0  # a revision turn: the term is informative


# ---- coverage: the answer's use of the relevant memory (issue 12 item 4) -----------------------------

LISBON = ev.MemoryBlock(block_id="lisbon", text="Lisbon trip: Alfama hotel, budget 1500 euros")
TRAM = ev.MemoryBlock(block_id="tram", text="Lisbon: tram 28 and Belem tower")
IRRELEVANT = [
    ev.MemoryBlock(block_id="garden", text="Gardening notes: tomatoes need sun, basil likes water daily."),
    ev.MemoryBlock(block_id="tax", text="Tax return due in April; receipts are in the blue folder."),
    ev.MemoryBlock(block_id="physics", text="Quantum chromodynamics: gluons bind quarks inside hadrons."),
]


def test_coverage_by_hand() -> None:
    answer = "Stay at the Alfama hotel within the 1500 euros budget; take tram 28."
    # Query terms {lisbon, trip, plan}. LISBON holds 2/3 of them and its 5 other terms are all in the
    # answer (use 5/min(10, 5) = 1); TRAM holds 1/3 and 2 of its 4 other terms are (use 2/4); the
    # gardening block holds none of the query and does not count.
    cov = memory_coverage("lisbon trip plan", answer, [LISBON, TRAM, IRRELEVANT[0]])
    assert cov == pytest.approx((2 / 3 * 1.0 + 1 / 3 * 0.5) / (2 / 3 + 1 / 3))


@pytest.mark.parametrize("profile", ["realmem", "multichallenge"])
def test_packing_irrelevant_memory_does_not_lower_m(profile: str) -> None:
    query, answer = "Plan the Lisbon trip", "Lisbon in May: Alfama hotel, two museums, 1500 euros budget."
    lean = judge_turn(query, answer, MEMORY, _state(), 0.0, 0.0, PROFILES[profile])
    for extra in range(1, len(IRRELEVANT) + 1):
        packed = [*MEMORY, *IRRELEVANT[:extra]]
        more = judge_turn(query, answer, packed, _state(), 0.0, 0.0, PROFILES[profile])
        assert more.coverage == pytest.approx(lean.coverage)
        assert more.memory_component >= lean.memory_component - 1e-12
        assert more.utility >= lean.utility - 1e-12


def test_answer_using_relevant_memory_covers_more_than_one_using_other_memory() -> None:
    packed = [LISBON, IRRELEVANT[0]]
    uses = judge_turn("Plan the Lisbon trip", "Alfama hotel, 1500 euros budget.", packed, _state(), 0.0, 0.0)
    # Draws on the packed gardening notes instead: memory, but not what the query needed.
    strays = judge_turn(
        "Plan the Lisbon trip", "Tomatoes need sun; basil likes water daily.", packed, _state(), 0.0, 0.0
    )
    assert uses.coverage == pytest.approx(1.0) and strays.coverage == 0.0
    assert uses.memory_component > strays.memory_component


def test_coverage_without_a_relevant_block_is_the_best_used_block() -> None:
    # "go on" shares no term with its memory: coverage is the use of the block the answer drew on most,
    # and a further unused block changes nothing.
    answer = "Next: the Alfama hotel and the 1500 euros budget."
    alone = memory_coverage("go on", answer, [LISBON])
    assert alone == pytest.approx(5 / 6)  # alfama, hotel, budget, 1500, euros / min(|answer| 6, |block| 7)
    assert memory_coverage("go on", answer, [LISBON, *IRRELEVANT]) == pytest.approx(alone)
    assert memory_coverage("go on", "Sure.", [LISBON]) == 0.0
