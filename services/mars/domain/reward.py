"""Turn-level reward (paper Eq. 17, Table 9) from deterministic lexical signals.

This is the "deterministic-v1" judge: it stands in for the paper's LLM judge using the auto-signals the
paper feeds that judge (coverage, overlap, length). It cannot detect hallucinated context use, so the
hallucination flag is always False here; an LLM judge fills it later through the same Judged message.

Coverage (the "retrieval coverage" term of M) is the answer's use of the *relevant* packed memory, not the
share of all packed memory that reappears in the answer: the latter falls whenever more memory is packed,
so it would punish an arm or view for context the answer never needed. Here (`memory_coverage`):

- a packed block is relevant when it holds at least `RELEVANT_QUERY_SHARE` of the query's content terms,
  and weighs by that share;
- the answer uses a block by the overlap coefficient of their content terms beyond the query's,
  |A & B| / min(|A|, |B|): 1 when the answer's new content all comes from the block, or the block all
  reappears in the answer (repeating the query is not using memory);
- coverage is the relevance-weighted mean use over relevant blocks; when no block is relevant (a follow-up
  like "go on" shares no terms with its memory), it is the use of the block the answer drew on most.

So packing an extra block that is not relevant never lowers coverage (nor M: the answer's grounding in the
packed memory can only rise), and an answer that draws on the relevant memory scores higher than one that
ignores it. `Judged.coverage` carries this measured value under every profile.

Profiles (Eq. 17 as the paper states it per benchmark): RealMem's M averages coverage, state alignment and
routing adequacy; MultiChallenge's M additionally averages in revision application, with coverage set to 1
because that benchmark has no explicit memory supervision. Penalty coefficients follow Table 9's text.
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
    """Eq. 17 per benchmark profile (paper B.5): penalty coefficients and the memory component's terms."""

    drift: float
    restart: float
    hallucination: float
    missing_history: float
    #: M also averages in normalized revision application (MultiChallenge).
    memory_includes_revision: bool = False
    #: Coverage enters M as 1: no explicit memory supervision (MultiChallenge).
    unit_coverage: bool = False


PROFILES: dict[str, JudgeProfile] = {
    "realmem": JudgeProfile(0.10, 0.06, 0.12, 0.12),
    "multichallenge": JudgeProfile(0.10, 0.12, 0.10, 0.10, memory_includes_revision=True, unit_coverage=True),
}

# Content tokens at which the length signal reaches ~63% of its maximum (1 - 1/e).
LENGTH_SCALE = 30.0
RESTART_OVERLAP = 0.05
DRIFT_OVERLAP = 0.02
# Share of the query's content terms a packed block must hold to count as relevant memory for coverage.
RELEVANT_QUERY_SHARE = 0.2


def _clip(v: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, v))


def compose_utility(
    rubric: ev.RubricScores,
    flags: ev.FailureFlags,
    coverage: float,
    final_step: bool,
    profile: JudgeProfile = PROFILES["realmem"],
) -> tuple[float, float, float, float, float]:
    """(M, A, Q, P, u) of Eq. 17 from 0-5 rubric scores, binary flags and coverage in [0, 1]; the profile
    decides M's terms (MultiChallenge: coverage as 1, plus revision application)."""
    memory_terms = [
        1.0 if profile.unit_coverage else coverage,
        rubric.state_alignment / 5.0,
        rubric.routing_adequacy / 5.0,
    ]
    if profile.memory_includes_revision:
        memory_terms.append(rubric.revision_application / 5.0)
    memory = sum(memory_terms) / len(memory_terms)
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


def _block_use(answer_terms: set[str], block_terms: set[str]) -> float:
    """Overlap coefficient |A & B| / min(|A|, |B|): how far the answer draws on the block, independent of
    which of the two is longer."""
    if not answer_terms or not block_terms:
        return 0.0
    return len(answer_terms & block_terms) / min(len(answer_terms), len(block_terms))


def memory_coverage(query: str, answer: str, packed_blocks: Sequence[ev.MemoryBlock]) -> float:
    """The answer's use of the relevant packed memory in [0, 1] (module docstring): relevance-weighted mean
    use of the blocks holding >= RELEVANT_QUERY_SHARE of the query's terms; with none, the best block's use."""
    query_terms = set(tokenize(query))
    # Terms the answer could take from the query itself are no evidence of memory use.
    answer_terms = set(tokenize(answer)) - query_terms
    weighted, weight_sum, best = 0.0, 0.0, 0.0
    for block in packed_blocks:
        terms = set(tokenize(block.text))
        use = _block_use(answer_terms, terms - query_terms)
        best = max(best, use)
        relevance = len(terms & query_terms) / len(query_terms) if query_terms else 0.0
        if relevance >= RELEVANT_QUERY_SHARE and terms - query_terms:
            weighted += relevance * use
            weight_sum += relevance
    return weighted / weight_sum if weight_sum > 0 else best


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
    coverage = memory_coverage(query, answer, packed_blocks) if (need_memory and has_memory) else 1.0
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
