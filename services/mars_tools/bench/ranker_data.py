"""Training data and leave-one-persona-out scoring of the learned memory ranker (`mars train ranker`).

Each RealMem persona is replayed once with the `mars` retriever (same memory, same context turns as `mars
bench realmem`); at every scored query the fused top CANDIDATES sessions are recorded with their features
(`mars.retrieval.ranker.candidate_features`). A LoCoMo conversation gives the same per question, its turns
the groups (the `mars bench locomo` memory). Scoring re-orders a query's candidates and hands the ranking to
the strict RealMem scorer, beside the fused ranking of the same replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from mars.retrieval.embedder import Embedder
from mars.retrieval.hybrid import POLICY_CONFIGS
from mars.retrieval.ranker import (
    CANDIDATES,
    FIT_HIDDEN,
    FIT_L2,
    FIT_STEPS,
    LearnedRanker,
    RankingQuery,
    candidate_features,
    fit_ranker,
)

from mars_tools.bench.locomo import Conversation, conversation_memory
from mars_tools.bench.policies import HybridSessionRetriever
from mars_tools.bench.realmem import Persona, Prediction, Query, Results, evaluate, replay
from mars_tools.bench.realmem_lopo import CONTEXT_TURNS

#: The ranking depth scored (the RealMem table's largest k).
DEPTH = 20


@dataclass(frozen=True)
class CandidateList:
    """One query's fused top candidates (keys in fused order), their features and gold flags."""

    query_id: str
    keys: list[str]
    features: np.ndarray
    gold: np.ndarray

    def training(self, weight: float = 1.0) -> RankingQuery:
        return RankingQuery(self.features, self.gold, weight)

    def ranked(self, ranker: LearnedRanker | None) -> list[str]:
        if ranker is None or len(self.keys) < 2:
            return list(self.keys)
        return [self.keys[i] for i in ranker.order(self.features)]


class CandidateRecorder(HybridSessionRetriever):
    """The `mars` RealMem retriever that records each query's candidates and answers with the fused order."""

    def __init__(self, embedder: Embedder, query_embedder: Embedder | None = None) -> None:
        super().__init__(embedder, POLICY_CONFIGS["mars"], CONTEXT_TURNS, query_embedder=query_embedder)
        self.recorded: dict[str, tuple[list[str], np.ndarray]] = {}

    def retrieve(self, query: Query, k: int) -> list[str]:
        signals = self._memory.candidates(query.text, self._context(query), CANDIDATES)
        if signals is None:
            return []
        self.recorded[query.query_id] = signals.keys, candidate_features(signals)
        return signals.keys[:k]


def realmem_candidates(
    persona: Persona,
    embedder: Embedder,
    query_embedder: Embedder | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[CandidateList]:
    """The persona's scored queries answered in replay order, each with its candidates (a query asked before
    any session has none and is left out: every ranking of it is empty)."""
    recorder = CandidateRecorder(embedder, query_embedder)
    replay(persona, recorder, DEPTH, progress=progress)
    out = []
    for q in persona.queries:
        if q.query_id in recorder.recorded:
            keys, x = recorder.recorded[q.query_id]
            out.append(CandidateList(q.query_id, keys, x, np.array([k in q.gold for k in keys])))
    return out


def locomo_candidates(conv: Conversation, embedder: Embedder) -> list[CandidateList]:
    """Every question of the conversation over its turns (the `mars bench locomo` memory: the mars fusion
    without the recency prior, each turn a group), evidence turns gold."""
    memory = conversation_memory(conv, embedder)
    out = []
    for i, q in enumerate(conv.questions):
        signals = memory.candidates(q.question, (), CANDIDATES)
        if signals is not None:
            gold = np.array([k in q.evidence for k in signals.keys])
            out.append(CandidateList(f"{conv.sample_id}/{i}", signals.keys, candidate_features(signals), gold))
    return out


def predictions(
    persona: str, lists: Sequence[CandidateList], ranker: LearnedRanker | None
) -> list[Prediction]:
    return [Prediction(persona, c.query_id, c.ranked(ranker)[:DEPTH]) for c in lists]


@dataclass(frozen=True)
class LopoScores:
    """The fused ranking and the leave-one-persona-out ranker's, scored on the same replay."""

    fused: Results
    ranker: Results


def leave_one_persona_out(
    personas: Sequence[Persona],
    lists: Mapping[str, Sequence[CandidateList]],
    extra: Sequence[CandidateList] = (),
    progress: Callable[[str], None] | None = None,
    hidden: int = FIT_HIDDEN,
    l2: float = FIT_L2,
    steps: int = FIT_STEPS,
    extra_weight: float = 1.0,
) -> LopoScores:
    """Each persona ranked by a model fitted on the other personas (and `extra`, e.g. LoCoMo, each of its
    queries counting `extra_weight` of a RealMem query)."""
    if len(personas) < 2:
        raise ValueError("leave-one-persona-out needs at least 2 personas")
    fused: list[Prediction] = []
    learned: list[Prediction] = []
    for held_out in personas:
        train = [c.training() for p in personas if p.name != held_out.name for c in lists[p.name]]
        ranker = fit_ranker([*train, *(c.training(extra_weight) for c in extra)], hidden, l2, steps)
        fused += predictions(held_out.name, lists[held_out.name], None)
        learned += predictions(held_out.name, lists[held_out.name], ranker)
        if progress is not None:
            progress(held_out.name)
    return LopoScores(evaluate(personas, fused), evaluate(personas, learned))
