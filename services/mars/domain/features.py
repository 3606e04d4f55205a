"""Router feature map phi(z_t, c~_t, q_t) (paper Eq. 14, Table 7).

Features use only the QTM state and pre-packing candidate-view load, never the model-specific packed
context or a topic identifier. All values lie in [0, 1] so LinUCB's ridge prior treats dimensions alike.

Layout (FEATURE_DIM = 35; the paper reports 30 for its own encoding):
  1  bias
  2  action one-hot (MATCH, NEW_TOPIC)
  4  query_type one-hot (STATIC, DYNAMIC, TEMPORAL, PROACTIVE)
  5  phase one-hot (EXPLORE, CONSTRAIN, REVISE, SYNTHESIZE, VERIFY)
  1  need_memory
  3  memory_span one-hot (NONE, ACTIVE_THREAD, CROSS_SESSION)
  3  ambiguity one-hot (LOW, MEDIUM, HIGH)
  2  retrieval_scope one-hot (LOCAL, GLOBAL)
  3  top_k_hint one-hot (3, 5, 8)
  1  prefer_recent
  1  lens == 3
  6  load: blocks/16, tokens/4000 (clipped), has_history, retrieved/8 (clipped), max and mean retrieval
     score as the view reports them: normalised per view into [0, 1] (memory_policy.relative_scores)
  3  position: min(depth, 20)/20, recent revision flag, recent finalization flag
An unspecified enum value leaves its one-hot group all zero.

Session position (Table 7: "turn depth, recent revision flag, finalization flag"). The current turn's
phase is already one-hot above, so the two flags look back instead: a REVISE (resp. SYNTHESIZE) turn among
the last RECENT_TURNS turns of the session before this one. They tell a fresh revision from one in an
ongoing edit loop, and a verification or touch-up after a synthesis from an early one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mars.v1 import events_pb2 as ev

_ACTIONS = (ev.MATCH, ev.NEW_TOPIC)
_QUERY_TYPES = (ev.STATIC, ev.DYNAMIC, ev.TEMPORAL, ev.PROACTIVE)
_PHASES = (ev.EXPLORE, ev.CONSTRAIN, ev.REVISE, ev.SYNTHESIZE, ev.VERIFY)
_SPANS = (ev.NONE, ev.ACTIVE_THREAD, ev.CROSS_SESSION)
_AMBIGUITY = (ev.LOW, ev.MEDIUM, ev.HIGH)
_SCOPES = (ev.LOCAL, ev.GLOBAL)
_TOP_K = (3, 5, 8)

FEATURE_NAMES: tuple[str, ...] = (
    "bias",
    *(f"action={ev.Action.Name(v)}" for v in _ACTIONS),
    *(f"query_type={ev.QueryType.Name(v)}" for v in _QUERY_TYPES),
    *(f"phase={ev.Phase.Name(v)}" for v in _PHASES),
    "need_memory",
    *(f"memory_span={ev.MemorySpan.Name(v)}" for v in _SPANS),
    *(f"ambiguity={ev.Ambiguity.Name(v)}" for v in _AMBIGUITY),
    *(f"scope={ev.RetrievalScope.Name(v)}" for v in _SCOPES),
    *(f"top_k={k}" for k in _TOP_K),
    "prefer_recent",
    "lens_full",
    "load.num_blocks",
    "load.estimated_tokens",
    "load.has_retrieved_history",
    "load.num_retrieved",
    "load.max_retrieval_score",
    "load.mean_retrieval_score",
    "pos.turn_depth",
    "pos.recent_revision",
    "pos.recent_finalization",
)
FEATURE_DIM: int = len(FEATURE_NAMES)

# Normalisers: typical upper ends of the candidate view (Table 6 caps recent at 4 and retrieval at 8).
MAX_BLOCKS = 16.0
MAX_TOKENS = 4000.0
MAX_RETRIEVED = 8.0
MAX_DEPTH = 20
#: How far back the session-position flags look: the session's previous turns, newest last.
RECENT_TURNS = 3
_PHASE_START = FEATURE_NAMES.index(f"phase={ev.Phase.Name(_PHASES[0])}")


def _one_hot(value: int, choices: tuple[int, ...]) -> list[float]:
    return [1.0 if value == c else 0.0 for c in choices]


def _unit(value: float) -> float:
    """Clipped to [0, 1]; NaN (which min/max would pass through, and which would poison the policy's
    matrices) reads as 0."""
    if math.isnan(value):
        return 0.0
    return min(max(value, 0.0), 1.0)


def featurize(
    state: ev.SessionState, load: ev.ViewLoad, turn_depth: int, recent_phases: Sequence[int] = ()
) -> np.ndarray:
    """Feature vector x_t (float64, length FEATURE_DIM, values in [0, 1]).

    `recent_phases`: the phases of the session's earlier turns, oldest first (only the last RECENT_TURNS
    count); empty when the caller has no history (the flags are then 0)."""
    tax = state.taxonomy
    values: list[float] = [1.0]
    values += _one_hot(state.action, _ACTIONS)
    values += _one_hot(state.query_type, _QUERY_TYPES)
    values += _one_hot(state.phase, _PHASES)
    values.append(1.0 if tax.need_memory else 0.0)
    values += _one_hot(tax.memory_span, _SPANS)
    values += _one_hot(tax.ambiguity, _AMBIGUITY)
    values += _one_hot(state.retrieval_scope, _SCOPES)
    values += _one_hot(state.top_k_hint, _TOP_K)
    values.append(1.0 if state.prefer_recent else 0.0)
    values.append(1.0 if state.lens_recommendation == 3 else 0.0)
    values += [
        min(max(load.num_blocks, 0) / MAX_BLOCKS, 1.0),
        min(max(load.estimated_tokens, 0) / MAX_TOKENS, 1.0),
        1.0 if load.has_retrieved_history else 0.0,
        min(max(load.num_retrieved, 0) / MAX_RETRIEVED, 1.0),
        # Already relative to the view's ranking (build_view); clipping only guards foreign producers.
        _unit(load.max_retrieval_score),
        _unit(load.mean_retrieval_score),
    ]
    last = list(recent_phases)[-RECENT_TURNS:]
    values += [
        min(max(turn_depth, 0), MAX_DEPTH) / MAX_DEPTH,
        1.0 if ev.REVISE in last else 0.0,
        1.0 if ev.SYNTHESIZE in last else 0.0,
    ]
    x = np.asarray(values, dtype=np.float64)
    assert x.shape == (FEATURE_DIM,)
    return x


def phase_of(features: Sequence[float]) -> int:
    """The phase a recorded state feature vector encodes (PHASE_UNSPECIFIED when it encodes none), so a
    router can recover a session's recent phases from the decisions it logged."""
    if len(features) != FEATURE_DIM:
        return int(ev.PHASE_UNSPECIFIED)
    hot = [p for i, p in enumerate(_PHASES) if features[_PHASE_START + i] >= 0.5]
    return int(hot[0]) if len(hot) == 1 else int(ev.PHASE_UNSPECIFIED)


# ---- the no-QTM baseline: features from the query embedding alone --------------------------------------

#: Projected embedding dimensions (+1 bias). A fixed random projection keeps LinUCB's matrices small
#: (33 x 33 per arm) while preserving inner products approximately (Johnson-Lindenstrauss).
QUERY_PROJECTION_DIM = 32
QUERY_FEATURE_DIM = QUERY_PROJECTION_DIM + 1
_PROJECTION_SEED = 20_260_101
_projections: dict[int, np.ndarray] = {}
#: Widest query embedding projected (all-MiniLM-L6-v2: 384; the widest common models: 4096).
MAX_QUERY_EMBEDDING_DIM = 8192


def _projection(embedding_dim: int) -> np.ndarray:
    matrix = _projections.get(embedding_dim)
    if matrix is None:
        # Seeded, so every router replica and every replay projects identically.
        rng = np.random.Generator(np.random.PCG64(_PROJECTION_SEED + embedding_dim))
        matrix = rng.standard_normal((QUERY_PROJECTION_DIM, embedding_dim)) / np.sqrt(QUERY_PROJECTION_DIM)
        _projections[embedding_dim] = matrix
    return matrix


def query_features(embedding: np.ndarray | list[float]) -> np.ndarray:
    """x = [1, P e / |e|] for the paper's no-QTM and MetaLLM-style baselines: the router sees the query
    embedding, not the session state or the view load. An empty embedding (memory ran lexical-only)
    leaves only the bias."""
    e = np.asarray(embedding, dtype=np.float64).ravel()
    x = np.zeros(QUERY_FEATURE_DIM)
    x[0] = 1.0
    if e.size > MAX_QUERY_EMBEDDING_DIM:
        # No embedding model is this wide: a foreign or corrupt event. Its projection (32 x size, cached
        # per size) would cost memory without bound, so it counts as no embedding.
        return x
    norm = float(np.linalg.norm(e))
    if e.size and norm > 0 and np.isfinite(norm):
        x[1:] = _projection(e.size) @ (e / norm)
    return x
