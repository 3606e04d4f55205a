"""The learned memory ranker: re-orders the hybrid retriever's top candidates by how its signals combine.

The hybrid retriever (`mars.retrieval.hybrid`) fuses fixed rankings (dense, BM25, recency, PRF, centroid)
with fixed weights. The ranker sees, for each of the fused top-N groups, the raw signals behind that fusion
(`GroupSignals`) and learns from the shared benchmarks how much each one is worth *for this query*: a
query whose dense scores are flat leans on BM25, one that names a number needs the group that has it.

Model: standardised features (`candidate_features`), a linear term plus one small tanh hidden layer, scored
per candidate; trained listwise (softmax over a query's candidates against its gold groups, L2, L-BFGS from
a seeded start) by `mars train ranker`, which also reports leave-one-persona-out figures. The model is a
small JSON file in the package; a missing or corrupt file leaves the fused ranking in place
(`load_ranker` returns None and says why).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Bumped whenever `candidate_features` changes: a model trained on other features is refused at load.
FEATURES_VERSION = "ranker-features-v2"
#: The model shipped in the package (`mars train ranker` writes it).
DEFAULT_RANKER = Path(__file__).resolve().parent / "models" / "ranker-v1.json"
#: The fused top-N re-ordered by the ranker; groups below it keep their fused order.
CANDIDATES = 50

#: A capitalised word not at a sentence start: a name, a product, a place (named-entity-like).
_NAME = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][\w'-]+")


@dataclass(frozen=True)
class QueryTerms:
    """What a query asks for, lexically: its content terms (with idf), its numbers and its names, each as the
    lexical index's tokens."""

    terms: Mapping[str, float]
    numbers: frozenset[str]
    names: frozenset[str]


def query_terms(text: str, tokens: Sequence[str], idf: Mapping[str, float]) -> QueryTerms:
    """`tokens`: the query's content tokens as the lexical index tokenises them; `idf`: their idf."""
    return QueryTerms(
        terms={t: idf.get(t, 0.0) for t in set(tokens)},
        # As the lexical index splits them: "3:30" is the tokens 3 and 30.
        numbers=frozenset(t for t in tokens if any(c.isdigit() for c in t)),
        names=frozenset(m.group(0).lower() for m in _NAME.finditer(text.strip())),
    )


@dataclass(frozen=True)
class GroupSignals:
    """The signals behind one fused ranking, for its top-N groups in fused order (arrays of length N).

    Ranks are 0-based among all the owner's groups (`n_groups`); a group absent from a list (no shared
    term) takes rank `n_groups`.
    """

    keys: list[str]
    n_groups: int
    has_context: bool
    dense_query: np.ndarray
    dense_mean: np.ndarray
    lexical_query: np.ndarray
    fused: np.ndarray
    dense_rank: np.ndarray
    lexical_rank: np.ndarray
    recency_rank: np.ndarray
    centroid: np.ndarray
    prf: np.ndarray
    chunks: np.ndarray
    doc_length: np.ndarray
    #: Per candidate, the share of the query's terms, idf-weighted terms, numbers and names it holds
    #: (`coverage`: one row of four).
    coverage: np.ndarray
    #: The candidates' centroids (unit rows; zero columns without dense search).
    centroids: np.ndarray


def coverage(query: QueryTerms, presence: Callable[[Sequence[str]], np.ndarray], n: int) -> np.ndarray:
    """Per candidate, the fraction of the query's terms, idf-weighted terms, numbers and names its text holds
    (one row of four per candidate); `presence(terms)` is the (terms x candidates) boolean matrix of which
    candidate's text holds which term."""
    out = np.zeros((n, 4))
    words = list(query.terms)
    if words and n:
        held = presence(words)
        out[:, 0] = held.mean(axis=0)
        idf = np.array([query.terms[w] for w in words])
        if idf.sum() > 0:
            out[:, 1] = idf @ held / idf.sum()
    for column, group in ((2, query.numbers), (3, query.names)):
        if group and n:
            out[:, column] = presence(sorted(group)).mean(axis=0)
    return out


FEATURE_NAMES: tuple[str, ...] = (
    "dense_query",
    "dense_query_gap",
    "dense_query_z",
    "dense_mean",
    "lexical_query_log",
    "lexical_query_share",
    "fused_share",
    "fused_rank_inv",
    "fused_rank_log",
    "dense_rank_log",
    "lexical_rank_log",
    "recency_rank_log",
    "recency_rank_share",
    "centroid",
    "centroid_gap",
    "prf",
    "chunks_log",
    "doc_length_log",
    "term_coverage",
    "idf_coverage",
    "number_coverage",
    "name_coverage",
    "has_context",
    "groups_log",
    "newer_max_similarity",
    "older_max_similarity",
    "newer_similar_log",
    "top_support",
)

#: Centroid similarity above which two candidates count as the same line of work (`newer_similar_log`).
SIMILAR = 0.8
#: The leading candidates whose centroids `top_support` averages.
SUPPORT_TOP = 10


def _neighbourhood(s: GroupSignals) -> np.ndarray:
    """How each candidate sits among the others: its highest centroid similarity to a newer and to an older
    candidate, how many newer candidates are near-duplicates of its topic (a later session of the same work
    often supersedes it), and its mean similarity to the leading candidates weighted by fused score."""
    n = len(s.keys)
    if n < 2 or not s.centroids.size:
        return np.zeros((n, 4))
    sim = s.centroids @ s.centroids.T
    np.fill_diagonal(sim, -1.0)
    newer = s.recency_rank[None, :] < s.recency_rank[:, None]
    older = s.recency_rank[None, :] > s.recency_rank[:, None]
    newer_max = np.where(newer, sim, -1.0).max(axis=1)
    older_max = np.where(older, sim, -1.0).max(axis=1)
    newer_similar = ((sim > SIMILAR) & newer).sum(axis=1)
    top = min(SUPPORT_TOP, n)
    weights = np.maximum(s.fused[:top], 0.0)
    near = np.where(sim[:, :top] > -1.0, sim[:, :top], 0.0)
    mass = weights.sum() - np.where(np.arange(n) < top, np.pad(weights, (0, n - top)), 0.0)
    support = (near @ weights) / np.maximum(mass, 1e-9)
    return np.stack([newer_max, older_max, np.log1p(newer_similar), support], axis=1)


def candidate_features(s: GroupSignals) -> np.ndarray:
    """One row per candidate, columns as FEATURE_NAMES; per-query normalisations are over the candidates.
    Built in blocks (a handful of array operations, not one per column: this runs on every view)."""
    n = len(s.keys)
    if n == 0:
        return np.zeros((0, len(FEATURE_NAMES)))
    spread = float(s.dense_query.std())
    z = (s.dense_query - s.dense_query.mean()) / spread if spread > 1e-9 else np.zeros(n)
    fused_rank = np.arange(n, dtype=np.float64)
    shares = np.stack([np.maximum(s.lexical_query, 0.0), s.fused])
    tops = shares.max(axis=1, keepdims=True)
    shares = np.divide(shares, tops, out=np.zeros_like(shares), where=tops > 0)
    logs = np.log1p(np.stack([shares[0] * tops[0], fused_rank, s.dense_rank, s.lexical_rank, s.recency_rank]))
    out = np.empty((n, len(FEATURE_NAMES)))
    out[:, :4] = np.stack([s.dense_query, s.dense_query - s.dense_query.max(), z, s.dense_mean], axis=1)
    out[:, 4] = logs[0]
    out[:, 5] = shares[0]
    out[:, 6] = shares[1]
    out[:, 7] = 1.0 / (1.0 + fused_rank)
    out[:, 8:12] = logs[1:].T
    out[:, 12] = s.recency_rank / max(s.n_groups, 1)
    out[:, 13:16] = np.stack([s.centroid, s.centroid - s.centroid.max(), s.prf], axis=1)
    out[:, 16:18] = np.log1p(np.stack([s.chunks, s.doc_length], axis=1))
    out[:, 18:22] = s.coverage
    out[:, 22] = 1.0 if s.has_context else 0.0
    out[:, 23] = math.log1p(s.n_groups)
    out[:, 24:28] = _neighbourhood(s)
    return out


class RankerError(ValueError):
    """A model file that cannot be used (unreadable, another feature version, wrong shapes)."""


@dataclass(frozen=True)
class LearnedRanker:
    """score(x) = w . z + v . tanh(W z + b), z the standardised features."""

    version: str
    mean: np.ndarray
    scale: np.ndarray
    linear: np.ndarray
    hidden_w: np.ndarray
    hidden_b: np.ndarray
    hidden_v: np.ndarray

    def scores(self, features: np.ndarray) -> np.ndarray:
        z = (features - self.mean) / self.scale
        out = z @ self.linear
        if len(self.hidden_v):
            out = out + np.tanh(z @ self.hidden_w.T + self.hidden_b) @ self.hidden_v
        return np.asarray(out, dtype=np.float64)

    def order(self, features: np.ndarray) -> list[int]:
        """Candidate indices best first; equal scores keep the fused order (a stable sort)."""
        return [int(i) for i in np.argsort(-self.scores(features), kind="stable")]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "features_version": FEATURES_VERSION,
            "features": list(FEATURE_NAMES),
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "linear": self.linear.tolist(),
            "hidden_w": self.hidden_w.tolist(),
            "hidden_b": self.hidden_b.tolist(),
            "hidden_v": self.hidden_v.tolist(),
        }

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> LearnedRanker:
        if raw.get("features_version") != FEATURES_VERSION:
            raise RankerError(
                f"model features {raw.get('features_version')!r}, this build computes {FEATURES_VERSION!r}"
            )
        f = len(FEATURE_NAMES)
        try:
            arrays = {k: np.asarray(raw[k], dtype=np.float64) for k in ("mean", "scale", "linear")}
            hidden_w = np.asarray(raw["hidden_w"], dtype=np.float64).reshape(-1, f)
            hidden_b = np.asarray(raw["hidden_b"], dtype=np.float64)
            hidden_v = np.asarray(raw["hidden_v"], dtype=np.float64)
        except (KeyError, TypeError, ValueError) as exc:
            raise RankerError(f"model arrays unreadable: {exc}") from exc
        if any(a.shape != (f,) for a in arrays.values()) or not (
            len(hidden_w) == len(hidden_b) == len(hidden_v)
        ):
            raise RankerError(f"model shapes do not fit {f} features")
        if not all(np.isfinite(a).all() for a in (*arrays.values(), hidden_w, hidden_b, hidden_v)):
            raise RankerError("model holds non-finite numbers")
        if (arrays["scale"] <= 0).any():
            raise RankerError("model scales must be positive")
        return cls(str(raw.get("version", "")), hidden_w=hidden_w, hidden_b=hidden_b, hidden_v=hidden_v, **arrays)

    @classmethod
    def load(cls, path: Path) -> LearnedRanker:
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RankerError(f"{path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise RankerError(f"{path}: not a JSON object")
        return cls.from_json(raw)


def load_ranker(path: Path | None = None) -> tuple[LearnedRanker | None, str]:
    """The ranker at `path` (default: the packaged one), or None and why: the caller keeps the fused order."""
    target = path or DEFAULT_RANKER
    try:
        return LearnedRanker.load(target), ""
    except RankerError as exc:
        return None, str(exc)



#: Training defaults (`mars train ranker`): hidden tanh units, L2 penalty, L-BFGS iterations. Linear: on
#: RealMem leave-one-persona-out, 4 or 8 hidden units fitted the training personas and lost on the held-out
#: one (8 units at l2 0.001: recall_all@10 0.664 against the fused 0.713); l2 0.3 of {0.01, 0.03, 0.1, 0.3}.
FIT_HIDDEN = 0
FIT_L2 = 0.3
FIT_STEPS = 300


@dataclass(frozen=True)
class RankingQuery:
    """One training query: its candidates' features (fused order) and which of them are gold."""

    features: np.ndarray
    gold: np.ndarray


def fit_ranker(
    queries: Sequence[RankingQuery],
    hidden: int = FIT_HIDDEN,
    l2: float = FIT_L2,
    steps: int = FIT_STEPS,
    seed: int = 0,
    version: str = "",
) -> LearnedRanker:
    """Listwise fit: for each query with a gold candidate, the softmax of its candidates' scores against
    its gold spread evenly (every gold group pulled up, as recall_all asks), mean over queries, plus
    l2 / 2 * |weights|^2; L-BFGS from a start drawn with `seed` (deterministic)."""
    from scipy.optimize import minimize

    used = [q for q in queries if q.gold.any() and len(q.gold) > 1]
    if not used:
        raise ValueError("no training query has a gold candidate")
    x = np.concatenate([q.features for q in used])
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    z = (x - mean) / scale
    starts = np.cumsum([0] + [len(q.gold) for q in used[:-1]])
    segment = np.repeat(np.arange(len(used)), [len(q.gold) for q in used])
    target = np.concatenate([q.gold / q.gold.sum() for q in used]).astype(np.float64)
    f = z.shape[1]
    rng = np.random.default_rng(seed)
    start = np.concatenate([np.zeros(f), rng.normal(0.0, 0.1, hidden * f), np.zeros(hidden), rng.normal(0.0, 0.1, hidden)])

    def unpack(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        w, rest = p[:f], p[f:]
        return w, rest[: hidden * f].reshape(hidden, f), rest[hidden * f : hidden * f + hidden], rest[hidden * f + hidden :]

    def objective(p: np.ndarray) -> tuple[float, np.ndarray]:
        w, hw, hb, hv = unpack(p)
        a = np.tanh(z @ hw.T + hb)
        s = z @ w + a @ hv
        top = np.maximum.reduceat(s, starts)
        e = np.exp(s - top[segment])
        total = np.add.reduceat(e, starts)
        log_p = s - top[segment] - np.log(total)[segment]
        loss = -float(target @ log_p) / len(used)
        ds = (e / total[segment] - target) / len(used)
        da = ds[:, None] * hv[None, :] * (1.0 - a * a)
        grad = np.concatenate([z.T @ ds, (da.T @ z).ravel(), da.sum(axis=0), a.T @ ds])
        penalty = np.concatenate([w, hw.ravel(), np.zeros(hidden), hv])
        return loss + 0.5 * l2 * float(penalty @ penalty), grad + l2 * penalty

    result = minimize(objective, start, jac=True, method="L-BFGS-B", options={"maxiter": steps})
    w, hw, hb, hv = unpack(result.x)
    return LearnedRanker(version, mean, scale, w, hw, hb, hv)
