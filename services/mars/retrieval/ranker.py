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

#: A capitalised word not at a sentence start: a name, a product, a place (named-entity-like). The capital
#: is matched first and the conditions on what precedes it looked back at from after it (a word boundary
#: before it; not the text's start; not ". " before it): the same matches as
#: `(?<![.!?]\s)(?<!^)\b[A-Z][\w'-]+`, found about three times faster (the scan stops at capitals only).
_NAME = re.compile(r"[A-Z](?<=\b[A-Z])(?<![.!?]\s[A-Z])(?<!^[A-Z])[\w'-]+")


@dataclass(frozen=True)
class QueryTerms:
    """What a query asks for, lexically: its content terms (with idf), its numbers and its names, each as the
    lexical index's tokens."""

    terms: Mapping[str, float]
    numbers: frozenset[str]
    names: frozenset[str]


def query_terms(text: str, tokens: Sequence[str], idf: Mapping[str, float]) -> QueryTerms:
    """`tokens`: the query's content tokens as the lexical index tokenises them; `idf`: their idf."""
    distinct = set(tokens)
    return QueryTerms(
        terms={t: idf.get(t, 0.0) for t in distinct},
        # As the lexical index splits them: "3:30" is the tokens 3 and 30. (A letters-only token holds no
        # digit: the quick test spares the per-character one for almost every token.)
        numbers=frozenset(t for t in distinct if not t.isalpha() and any(c.isdigit() for c in t)),
        names=frozenset(m.group(0).lower() for m in _NAME.finditer(text.strip())),
    )


@dataclass(frozen=True)
class GroupSignals:
    """The signals behind one fused ranking, for its top-N groups in fused order (arrays of length N).

    Ranks are 0-based among the groups the query was ranked among (`n_groups`: the owner's, less any
    excluded); a group absent from a list (no shared term) takes rank `n_groups`.
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
    candidate's text holds which term (asked once, for the terms and then the numbers and names not among
    them)."""
    out = np.zeros((n, 4))
    words = list(query.terms)
    extra = sorted((query.numbers | query.names) - query.terms.keys())
    if not n or not (words or extra):
        return out
    asked = [*words, *extra]
    held = presence(asked).astype(np.float64)
    k = len(words)
    # How many of the terms, of the numbers and of the names each candidate holds (exact: sums of ones),
    # then each over its count: exactly the mean of the booleans.
    picks = np.zeros((3, len(asked)))
    picks[0, :k] = 1.0
    if query.numbers or query.names:
        row = {w: i for i, w in enumerate(asked)}
        picks[1, [row[t] for t in query.numbers]] = 1.0
        picks[2, [row[t] for t in query.names]] = 1.0
    sizes = np.array([max(k, 1), max(len(query.numbers), 1), max(len(query.names), 1)], dtype=np.float64)
    out[:, [0, 2, 3]] = (picks @ held).T / sizes
    if k:
        idf = np.fromiter(query.terms.values(), np.float64, k)
        total = float(idf.sum())
        if total > 0:
            out[:, 1] = idf @ held[:k] / total
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
    out = np.zeros((n, 4))
    if n < 2 or not s.centroids.size:
        return out
    centroids = np.ascontiguousarray(s.centroids)
    sim = centroids @ centroids.T  # exactly symmetric: numpy computes a @ a.T as one triangle (syrk), mirrored
    sim.flat[:: n + 1] = -1.0  # a candidate is not its own neighbour
    rank = s.recency_rank
    # [i, j]: the similarity of i to j where j is newer than i, else -1. Transposed, "j older than i":
    # row maxima are the newer neighbours', column maxima the older ones'.
    newer = np.where(rank < rank[:, None], sim, -1.0)
    out[:, 0] = newer.max(axis=1)
    out[:, 1] = newer.max(axis=0)
    out[:, 2] = np.log1p((newer > SIMILAR).sum(axis=1))
    top = min(SUPPORT_TOP, n)
    weights = np.maximum(s.fused[:top], 0.0)
    near = sim[:, :top]
    near = np.where(near > -1.0, near, 0.0)
    # The leading candidates' weight but a candidate's own.
    mass = np.full(n, weights.sum())
    mass[:top] -= weights
    out[:, 3] = (near @ weights) / np.maximum(mass, 1e-9)
    return out


def candidate_features(s: GroupSignals) -> np.ndarray:
    """One row per candidate, columns as FEATURE_NAMES; per-query normalisations are over the candidates.
    Written column block by column block into one array (this runs on every ranked view)."""
    n = len(s.keys)
    out = np.empty((n, len(FEATURE_NAMES)))
    if n == 0:
        return out
    dense = s.dense_query
    centred = dense - dense.mean()
    # The population standard deviation, as ndarray.std computes it.
    spread = math.sqrt(float((centred * centred).sum()) / n)
    out[:, 0] = dense
    out[:, 1] = dense - dense.max()
    out[:, 2] = centred / spread if spread > 1e-9 else 0.0
    out[:, 3] = s.dense_mean
    lexical = np.maximum(s.lexical_query, 0.0)
    lexical_top = float(lexical.max())
    out[:, 5] = lexical / lexical_top if lexical_top > 0 else 0.0
    # log1p(share * top), not log1p of the score: the share's rounding is the feature's.
    np.log1p(out[:, 5] * lexical_top, out=out[:, 4])
    fused_top = float(s.fused.max())
    out[:, 6] = s.fused / fused_top if fused_top > 0 else 0.0
    fused_rank = np.arange(n, dtype=np.float64)
    out[:, 7] = 1.0 / (1.0 + fused_rank)
    for column, values in ((8, fused_rank), (9, s.dense_rank), (10, s.lexical_rank), (11, s.recency_rank)):
        np.log1p(values, out=out[:, column])
    out[:, 12] = s.recency_rank / max(s.n_groups, 1)
    out[:, 13] = s.centroid
    out[:, 14] = s.centroid - s.centroid.max()
    out[:, 15] = s.prf
    np.log1p(s.chunks, out=out[:, 16])
    np.log1p(s.doc_length, out=out[:, 17])
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
        order: list[int] = np.argsort(-self.scores(features), kind="stable").tolist()
        return order

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
    """One training query: its candidates' features (fused order), which of them are gold, and how much it
    counts in the fit (e.g. a LoCoMo question beside RealMem's; 0: not at all)."""

    features: np.ndarray
    gold: np.ndarray
    weight: float = 1.0


def fit_ranker(
    queries: Sequence[RankingQuery],
    hidden: int = FIT_HIDDEN,
    l2: float = FIT_L2,
    steps: int = FIT_STEPS,
    seed: int = 0,
    version: str = "",
) -> LearnedRanker:
    """Listwise fit: for each query with a gold candidate, the softmax of its candidates' scores against
    its gold spread evenly (every gold group pulled up, as recall_all asks), mean over queries weighted by
    their `weight`, plus l2 / 2 * |weights|^2; L-BFGS from a start drawn with `seed` (deterministic). The
    features are standardised by their mean and deviation weighted alike (a query of weight 0 changes
    nothing; with every weight 1, the plain mean over queries)."""
    from scipy.optimize import minimize

    if any(not (q.weight >= 0.0 and math.isfinite(q.weight)) for q in queries):
        raise ValueError("query weights must be finite and at least 0")
    used = [q for q in queries if q.gold.any() and len(q.gold) > 1 and q.weight > 0]
    if not used:
        raise ValueError("no training query has a gold candidate")
    x = np.concatenate([q.features for q in used])
    starts = np.cumsum([0] + [len(q.gold) for q in used[:-1]])
    segment = np.repeat(np.arange(len(used)), [len(q.gold) for q in used])
    row_weight = np.array([q.weight for q in used])[segment]
    mean = (x * row_weight[:, None]).sum(axis=0) / row_weight.sum()
    scale = np.sqrt(((x - mean) ** 2 * row_weight[:, None]).sum(axis=0) / row_weight.sum())
    scale = np.where(scale > 1e-9, scale, 1.0)
    z = (x - mean) / scale
    # Each query's gold share times its weight, over the total weight (the number of queries when all are 1).
    total_weight = float(sum(q.weight for q in used))
    target = np.concatenate([q.gold / q.gold.sum() * q.weight for q in used]).astype(np.float64)
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
        loss = -float(target @ log_p) / total_weight
        ds = (e / total[segment] * row_weight - target) / total_weight
        da = ds[:, None] * hv[None, :] * (1.0 - a * a)
        grad = np.concatenate([z.T @ ds, (da.T @ z).ravel(), da.sum(axis=0), a.T @ ds])
        penalty = np.concatenate([w, hw.ravel(), np.zeros(hidden), hv])
        return loss + 0.5 * l2 * float(penalty @ penalty), grad + l2 * penalty

    result = minimize(objective, start, jac=True, method="L-BFGS-B", options={"maxiter": steps})
    w, hw, hb, hv = unpack(result.x)
    return LearnedRanker(version, mean, scale, w, hw, hb, hv)
