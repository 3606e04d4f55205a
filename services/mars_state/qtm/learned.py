"""The learned QTM controller (`MARS_STATE_QTM_BACKEND=learned`): one small softmax model per Table 5 decision
over features the service already has, no LLM call.

Features of a turn (`featurize`):
  - the turn's MiniLM embedding (the memory service's embedder, cached),
  - its cosine similarity to the active thread's centroid, to the closest and to the last thread turn,
  - the thread's length, and lexical overlap with it,
  - the rules' lexical cues (revision, finalization, verification, constraint, temporal, quantity,
    proactive, anaphora, recency), the turn's length and a question mark,
  - the rules backend's own state, one-hot (so the model learns where the rules are right),
  - hashed word n-grams of the turn (words, word pairs, its first three and its last word: the move a turn
    makes is in its wording, which a sentence embedding mostly averages away) and of the thread's last turn.

Heads: action, query_type, phase, need_memory, retrieval_scope, ambiguity. memory_span follows from need
and scope as in the rules (NONE without memory, CROSS_SESSION for GLOBAL, else ACTIVE_THREAD); top-k,
recency and lens follow the rules' budget logic. The state then goes through the same guardrails as any
controller's (`mars_state.qtm.guard`). The model is a small .npz file (`mars train qtm` writes it), loaded at start.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from mars.domain.state_rules import cue_flags, estimate_state
from mars.domain.text import overlap, tokenize
from mars.llm_json import JsonReply

from mars_state.qtm.labelled import CONTEXT_TURNS, FIELDS, state_labels

#: Bumped whenever `featurize` changes: a model trained on other features is refused at load.
FEATURES_VERSION = "qtm-learned-features-v2"
#: The model shipped in the package.
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "qtm-learned-v2.npz"
#: Hashed n-gram buckets of the turn and of the active thread's last turn.
TURN_NGRAM_BUCKETS = 2048
CONTEXT_NGRAM_BUCKETS = 512
#: Feature weights: the embedding's unit-norm coordinates are small beside the 0/1 features (standardising
#: them instead amplified their noise: leave-one-persona-out phase 0.64 vs 0.72), and the previous turn's
#: wording counts half. Only the dense block between the embedding and the n-grams (similarities, shape,
#: cues, the rules' state) is standardised (`LearnedModel.fit`): the thread similarities need their spread.
EMBEDDING_WEIGHT = 3.0
CONTEXT_NGRAM_WEIGHT = 0.5
#: Training defaults of every head (`SoftmaxHead.fit`, `mars train qtm`): L2 penalty on the summed loss,
#: L-BFGS iterations at most, and the power of the inverse class frequency that weighs each class.
FIT_L2 = 10.0
FIT_STEPS = 150
FIT_BALANCE = 0.5
#: Decision heads and their classes, in the labelled set's terms: every Table 5 field of the set but the
#: memory span, which follows from need and scope.
HEADS: dict[str, tuple[str, ...]] = {
    field: values for field, values in FIELDS.items() if field != "memory_span"
}

Embed = Callable[[Sequence[str]], np.ndarray]


class ModelFileError(ValueError):
    """The model file is missing, unreadable or for other features."""


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 0 else v


def _one_hot(value: str, classes: Sequence[str]) -> list[float]:
    return [1.0 if value == c else 0.0 for c in classes]


_NGRAM_TOKEN = re.compile(r"[a-z0-9']+|[?!]")


def hashed_ngrams(text: str, buckets: int, leading: int = 3) -> np.ndarray:
    """0/1 vector of the text's hashed word n-grams: words (stopwords kept: "did", "is", "what" carry the
    move), word pairs, the first `leading` words by position and the last word. blake2b, not hash(), so
    every process and replica computes the same buckets."""
    words = _NGRAM_TOKEN.findall(text.lower())
    grams = [*words, *(f"{a} {b}" for a, b in pairwise(words))]
    grams += [f"^{i}:{w}" for i, w in enumerate(words[:leading])]
    if words:
        grams.append(f"${words[-1]}")
    v = np.zeros(buckets)
    for g in grams:
        v[int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") % buckets] = 1.0
    return v


def _dense_features() -> int:
    """Length of the standardised block: similarity (4), shape (4), cues, the rules' one-hot state."""
    return 8 + len(cue_flags("")) + sum(len(classes) for classes in HEADS.values())


def standardised_columns(features: int) -> slice:
    """The dense block of a feature vector of length `features` (the embedding's size varies by embedder)."""
    end = features - TURN_NGRAM_BUCKETS - CONTEXT_NGRAM_BUCKETS
    return slice(end - _dense_features(), end)


def featurize(text: str, context: Sequence[str], embed: Embed) -> np.ndarray:
    """The feature vector of a turn given its active thread (earlier user turns, newest last)."""
    context = [c for c in context if c.strip()][-CONTEXT_TURNS:]
    vectors = embed([text, *context])
    turn = _unit(np.asarray(vectors[0], dtype=np.float64))
    if context:
        thread = np.stack([_unit(np.asarray(v, dtype=np.float64)) for v in vectors[1:]])
        sims = thread @ turn
        centroid = float(_unit(thread.mean(axis=0)) @ turn)
        similarity = [centroid, float(sims.max()), float(sims[-1]), 1.0]
        lexical = overlap(text, "\n".join(context))
    else:
        similarity, lexical = [0.0, 0.0, 0.0, 0.0], 0.0
    cues = [1.0 if on else 0.0 for on in cue_flags(text).values()]
    words = len(tokenize(text))
    shape = [math.log1p(words) / 4.0, 1.0 if "?" in text else 0.0, len(context) / CONTEXT_TURNS, lexical]
    rules = state_labels(estimate_state(text, context))
    rule_hot = [x for head, classes in HEADS.items() for x in _one_hot(rules[head], classes)]
    return np.concatenate(
        [
            EMBEDDING_WEIGHT * turn,
            np.asarray(similarity + shape + cues + rule_hot, dtype=np.float64),
            hashed_ngrams(text, TURN_NGRAM_BUCKETS),
            CONTEXT_NGRAM_WEIGHT * hashed_ngrams(context[-1] if context else "", CONTEXT_NGRAM_BUCKETS, 0),
        ]
    )


@dataclass
class SoftmaxHead:
    """Multinomial logistic regression on standardised features."""

    classes: tuple[str, ...]
    weights: np.ndarray  # (features, classes)
    bias: np.ndarray  # (classes,)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        z = x @ self.weights + self.bias
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return np.asarray(e / e.sum(axis=-1, keepdims=True))

    @classmethod
    def fit(
        cls,
        x: np.ndarray,
        labels: Sequence[str],
        classes: tuple[str, ...],
        l2: float = FIT_L2,
        steps: int = FIT_STEPS,
        balance: float = FIT_BALANCE,
    ) -> SoftmaxHead:
        """Minimises the class-weighted cross-entropy summed over the rows plus l2/2 * |weights|^2 (the bias
        free) by L-BFGS from zero weights, at most `steps` iterations: deterministic, no sampling. A class is
        weighted by its inverse frequency to the power `balance`, so a rare value (NEW_TOPIC, HIGH ambiguity)
        is not drowned out: 1 weighs every class equally (best for balanced accuracy, not for accuracy), 0
        not at all; 0.5 gave the best leave-one-persona-out accuracy on p01-p12 (phase 0.743 against 0.719 at
        1 and 0.725 at 0; query type 0.777 against 0.761 at both)."""
        n, d = x.shape
        k = len(classes)
        y = np.zeros((n, k))
        index = {c: i for i, c in enumerate(classes)}
        for row, label in enumerate(labels):
            y[row, index[label]] = 1.0
        counts = y.sum(axis=0)
        class_weight = np.where(counts > 0, (n / (k * np.maximum(counts, 1.0))) ** balance, 0.0)
        sample_weight = (y * class_weight).sum(axis=1, keepdims=True)
        # Training only: scipy costs the state service half a second of CPU at every start if imported above.
        from scipy.optimize import minimize
        from scipy.sparse import csr_matrix

        rows = csr_matrix(x)  # the n-gram buckets are mostly zero: ~7x fewer multiplications
        rows_t = rows.T.tocsr()

        def objective(flat: np.ndarray) -> tuple[float, np.ndarray]:
            w, b = flat[: d * k].reshape(d, k), flat[d * k :]
            z = rows @ w + b
            z = z - z.max(axis=1, keepdims=True)
            log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            loss = -float((sample_weight * y * log_p).sum()) + 0.5 * l2 * float((w * w).sum())
            grad = (np.exp(log_p) - y) * sample_weight
            return loss, np.concatenate([(rows_t @ grad + l2 * w).ravel(), grad.sum(axis=0)])

        result = minimize(
            objective, np.zeros(d * k + k), jac=True, method="L-BFGS-B", options={"maxiter": steps}
        )
        flat = result.x
        return cls(classes, flat[: d * k].reshape(d, k).copy(), flat[d * k :].copy())


@dataclass
class LearnedModel:
    """Standardisation of the dense block plus one head per decision; saved as one .npz file."""

    mean: np.ndarray
    scale: np.ndarray
    heads: dict[str, SoftmaxHead]
    meta: dict[str, Any]

    @property
    def features(self) -> int:
        return int(self.mean.shape[0])

    @classmethod
    def fit(
        cls,
        x: np.ndarray,
        labels: Sequence[dict[str, str]],
        meta: dict[str, Any] | None = None,
        heads: Sequence[str] = tuple(HEADS),
        **kw: Any,
    ) -> LearnedModel:
        """Standardises the dense block and fits the named `heads` (all by default; a model of fewer heads
        is for scoring only: `predict` answers those)."""
        mean, scale = np.zeros(x.shape[1]), np.ones(x.shape[1])
        dense = standardised_columns(x.shape[1])
        mean[dense] = x[:, dense].mean(axis=0)
        spread = x[:, dense].std(axis=0)
        scale[dense] = np.where(spread < 1e-6, 1.0, spread)
        z = (x - mean) / scale
        fitted = {}
        for head in heads:
            # A row may label some heads only (a RealMem session start labels the action alone).
            rows = [i for i, lab in enumerate(labels) if head in lab]
            fitted[head] = SoftmaxHead.fit(z[rows], [labels[i][head] for i in rows], HEADS[head], **kw)
        return cls(mean, scale, fitted, {"features": FEATURES_VERSION, **(meta or {})})

    def predict(self, features: np.ndarray) -> dict[str, tuple[str, float]]:
        """Per head: the most probable class and its probability."""
        z = (features - self.mean) / self.scale
        out = {}
        for name, head in self.heads.items():
            p = head.probabilities(z[None, :])[0]
            best = int(p.argmax())
            out[name] = (head.classes[best], float(p[best]))
        return out

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {
            "mean": self.mean.astype(np.float32),
            "scale": self.scale.astype(np.float32),
        }
        for name, head in self.heads.items():
            # float16 keeps the file small (~60 KB); the decisions are the same as at float32.
            arrays[f"{name}.weights"] = head.weights.astype(np.float16)
            arrays[f"{name}.bias"] = head.bias.astype(np.float32)
        meta = {**self.meta, "classes": {n: list(h.classes) for n, h in self.heads.items()}}
        arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as fh:
            np.savez_compressed(fh, **arrays)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> LearnedModel:
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                if meta.get("features") != FEATURES_VERSION:
                    raise ModelFileError(
                        f"{path} was trained on features {meta.get('features')!r}; this build computes "
                        f"{FEATURES_VERSION!r} (retrain with `mars train qtm`)"
                    )
                heads = {
                    name: SoftmaxHead(
                        tuple(meta["classes"][name]),
                        data[f"{name}.weights"].astype(np.float64),
                        data[f"{name}.bias"].astype(np.float64),
                    )
                    for name in HEADS
                }
                mean, scale = data["mean"].astype(np.float64), data["scale"].astype(np.float64)
        except ModelFileError:
            raise
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
            raise ModelFileError(f"cannot load the QTM model {path}: {type(exc).__name__}: {exc}") from exc
        for name, head in heads.items():
            if head.weights.shape != (mean.shape[0], len(head.classes)) or tuple(head.classes) != HEADS[name]:
                raise ModelFileError(f"{path}: head {name} does not fit the features or Table 5")
        if scale.shape != mean.shape or not np.all(scale > 0):
            raise ModelFileError(f"{path}: its standardisation does not fit the features")
        return cls(mean, scale, heads, meta)


def state_json(predicted: dict[str, tuple[str, float]], text: str, context: Sequence[str]) -> dict[str, Any]:
    """The controller's answer in the QTM JSON schema: the heads' decisions, and the memory budget derived
    from them as the rules derive theirs."""
    action = predicted["action"][0]
    query_type = predicted["query_type"][0]
    phase = predicted["phase"][0]
    need = int(predicted["need_memory"][0])
    scope = predicted["retrieval_scope"][0] if need else "LOCAL"
    span = "NONE" if not need else ("CROSS_SESSION" if scope == "GLOBAL" else "ACTIVE_THREAD")
    if phase == "SYNTHESIZE" or query_type == "TEMPORAL":
        top_k = 8
    elif action == "MATCH":
        top_k = 5
    else:
        top_k = 3
    flags = cue_flags(text)
    prefer_recent = int(phase in ("REVISE", "VERIFY") or (query_type == "TEMPORAL" and flags["recency"]))
    confidence = min(p for _, p in predicted.values())
    return {
        "action": action,
        "query_type": query_type,
        "phase": phase,
        "taxonomy": {
            "need_memory": need,
            "memory_span": span,
            "ambiguity": predicted["ambiguity"][0],
            "risk_flags": [
                name for name in ("revision", "finalization", "temporal", "quantity") if flags[name]
            ],
        },
        "lens_recommendation": 3 if need else 0,
        "top_k_hint": top_k,
        "prefer_recent": prefer_recent,
        "retrieval_scope": scope,
        "lens_confidence": round(confidence, 4),
        "lens_reason": f"learned: {phase.lower()} {query_type.lower()} turn, {'memory on' if need else 'no memory'}",
    }


class LearnedController:
    """The Controller interface (mars_state.qtm.controllers) over a LearnedModel: no endpoint, no tokens."""

    name = "learned"
    calls_llm = False

    def __init__(
        self,
        model: LearnedModel,
        embed: Embed,
        forget: Callable[[], int] = lambda: 0,
        cached: Callable[[str], np.ndarray | None] = lambda _text: None,
        embedder_tag: str = "",
    ) -> None:
        self.model = model
        self.prompt_version = str(model.meta.get("version", "learned"))
        self._embed = embed
        self._forget = forget
        self._cached = cached
        #: The tag of the embedder's vectors (mars.retrieval.embedder.embedder_tag).
        self.embedder_tag = embedder_tag

    def cached_embedding(self, text: str) -> np.ndarray | None:
        """The turn's embedding if the controller computed it (nothing is computed here): handed on so the
        memory service does not embed the same text again."""
        return self._cached(text)

    def forget_cached(self) -> int:
        """Drop the cached embeddings of turns (keyed by their text): a user was forgotten."""
        return self._forget()

    def answer(self, text: str, active_context: Sequence[str]) -> dict[str, Any]:
        return state_json(
            self.model.predict(featurize(text, active_context, self._embed)), text, active_context
        )

    async def call(self, text: str, active_context: Sequence[str]) -> JsonReply:
        # The embedding runs off the event loop (a few ms for a text not embedded before).
        state = await asyncio.to_thread(self.answer, text, active_context)
        return JsonReply(json.dumps(state), 0, 0, False)

    async def aclose(self) -> None:
        return None
