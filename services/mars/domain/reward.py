"""Turn-level reward (paper Eq. 17, Table 9) from deterministic lexical signals.

This is the "deterministic-v1" judge: it stands in for the paper's LLM judge using the auto-signals the
paper feeds that judge (coverage, overlap, length). It cannot detect hallucinated context use, so the
hallucination flag is always False here; an LLM judge fills it later through the same Judged message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mars.domain.text import overlap, tokenize
from mars.v1 import events_pb2 as ev

JUDGE_NAME = "deterministic-v1"

# Eq. 17 component weights.
W_MEMORY, W_ANSWER, W_QUALITY = 0.45, 0.40, 0.15


@dataclass(frozen=True)
class JudgeProfile:
    """Eq. 17 penalty coefficients per benchmark profile (paper Table 9)."""

    drift: float
    restart: float
    hallucination: float
    missing_history: float


PROFILES: dict[str, JudgeProfile] = {
    "realmem": JudgeProfile(0.10, 0.06, 0.12, 0.12),
    "multichallenge": JudgeProfile(0.10, 0.12, 0.10, 0.10),
}

# Content tokens at which the length signal reaches ~63% of its maximum (1 - 1/e).
LENGTH_SCALE = 30.0
RESTART_OVERLAP = 0.05
DRIFT_OVERLAP = 0.02


def _clip(v: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, v))


def compose_utility(
    rubric: ev.RubricScores,
    flags: ev.FailureFlags,
    coverage: float,
    final_step: bool,
    profile: JudgeProfile = PROFILES["realmem"],
) -> tuple[float, float, float, float, float]:
    """(M, A, Q, P, u) of Eq. 17 from 0-5 rubric scores, binary flags and coverage in [0, 1]."""
    memory = (coverage + rubric.state_alignment / 5.0 + rubric.routing_adequacy / 5.0) / 3.0
    answer = (
        rubric.answer_helpfulness / 5.0 + rubric.state_alignment / 5.0 + (1.0 - flags.hallucination)
    ) / 3.0
    if final_step:
        quality = (rubric.intermediate_product / 5.0 + rubric.final_integration / 5.0) / 2.0
    else:
        quality = rubric.intermediate_product / 5.0
    penalty = (
        profile.drift * flags.topic_drift
        + profile.restart * flags.restart
        + profile.hallucination * flags.hallucination
        + profile.missing_history * flags.severe_missing_history
    )
    utility = _clip(W_MEMORY * memory + W_ANSWER * answer + W_QUALITY * quality - penalty, 0.0, 1.0)
    return memory, answer, quality, penalty, utility


def judge_turn(
    query: str,
    answer: str,
    packed_blocks: Sequence[ev.MemoryBlock],
    state: ev.SessionState,
    gen_cost_usd: float,
    lambda_cost: float,
    profile: JudgeProfile = PROFILES["realmem"],
) -> ev.Judged:
    """Arm-independent Judged fields; the caller adds turn, arm, policy_id and features."""
    judged = ev.Judged(judge=JUDGE_NAME, cost_usd=gen_cost_usd, lambda_cost=lambda_cost)
    if not answer.strip():
        # No answer is a failed turn for the user: zero utility regardless of memory signals.
        judged.reward = -lambda_cost * gen_cost_usd
        return judged

    memory_text = "\n".join(b.text for b in packed_blocks)
    has_memory = bool(memory_text.strip())
    need_memory = state.taxonomy.need_memory == 1

    length = 1.0 - math.exp(-len(tokenize(answer)) / LENGTH_SCALE)
    query_cov = overlap(query, answer)  # how much of the request the answer addresses
    helpfulness = 5.0 * (0.5 * length + 0.5 * query_cov) if tokenize(query) else 5.0 * length

    ans_in_mem = overlap(answer, memory_text) if has_memory else 0.0
    ans_in_query = overlap(answer, query)
    if need_memory:
        # Answers grounded in the packed memory use its vocabulary; 50% reuse already counts as fully aligned.
        alignment = 5.0 * (0.4 + 0.6 * min(1.0, 2.0 * ans_in_mem))
    else:
        alignment = 4.0
    coverage = overlap(memory_text, answer) if (need_memory and has_memory) else 1.0
    revise = state.phase == ev.REVISE
    final_step = state.phase == ev.SYNTHESIZE

    rubric = judged.rubric
    rubric.answer_helpfulness = _clip(helpfulness, 0.0, 5.0)
    rubric.state_alignment = _clip(alignment, 0.0, 5.0)
    rubric.revision_application = 5.0 * min(1.0, 2.0 * ans_in_mem) if revise else 5.0
    # Without a model-specific signal, adequacy is read from answer substance: a truncated answer suggests
    # the arm could not handle the turn.
    rubric.routing_adequacy = 5.0 * (0.5 + 0.5 * length)
    rubric.intermediate_product = (rubric.answer_helpfulness + rubric.state_alignment) / 2.0
    rubric.final_integration = 5.0 * min(1.0, 2.0 * coverage) if final_step else rubric.intermediate_product

    flags = judged.flags
    flags.restart = revise and ans_in_mem < RESTART_OVERLAP
    flags.severe_missing_history = need_memory and not packed_blocks
    flags.topic_drift = (
        state.action == ev.MATCH and ans_in_query < DRIFT_OVERLAP and ans_in_mem < DRIFT_OVERLAP
    )
    flags.hallucination = False  # needs an LLM judge

    judged.coverage = coverage
    judged.final_step = final_step
    m, a, q, p, u = compose_utility(rubric, flags, coverage, final_step, profile)
    judged.memory_component = m
    judged.answer_component = a
    judged.quality_component = q
    judged.penalty = p
    judged.utility = u
    judged.reward = u - lambda_cost * gen_cost_usd
    return judged
