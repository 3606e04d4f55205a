"""Memory policies as RealMem retrievers: the same HybridMemory the memory service uses, fed the
benchmark's sessions in list order (only text, time and order inform retrieval)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from mars.retrieval.embedder import Embedder, LruEmbedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridConfig, HybridMemory
from mars.retrieval.ranker import LearnedRanker, load_ranker

from mars_tools.bench.realmem import Query, Retriever, Session


def session_chunks(session: Session) -> list[str]:
    """Turn pairs (a user turn with the assistant reply that follows), speaker-prefixed."""
    chunks: list[str] = []
    current: list[str] = []
    for turn in session.turns:
        if turn.speaker == "User" and current:
            chunks.append("\n".join(current))
            current = []
        current.append(f"{turn.speaker}: {turn.text}")
    if current:
        chunks.append("\n".join(current))
    return chunks


class CachingEmbedder:
    """Wraps an embedder with an on-disk cache keyed by text hash (benchmark re-runs and tuning)."""

    def __init__(self, inner: Embedder, cache_dir: str | Path | None = None) -> None:
        self.inner = inner
        self._dir = Path(cache_dir) if cache_dir else None
        self._mem: dict[str, np.ndarray] = {}
        if self._dir:
            self._dir.mkdir(parents=True, exist_ok=True)
            path = self._dir / "embeddings.npz"
            if path.exists():
                data = np.load(path)
                self._mem = {k: data[k] for k in data.files}
        self._dirty = False

    @property
    def dim(self) -> int:
        return self.inner.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        keys = [hashlib.sha1(t.encode()).hexdigest() for t in texts]
        missing = [i for i, k in enumerate(keys) if k not in self._mem]
        if missing:
            vecs = self.inner.encode([texts[i] for i in missing])
            for i, v in zip(missing, vecs, strict=True):
                self._mem[keys[i]] = v
            self._dirty = True
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self._mem[k] for k in keys]).astype(np.float32)

    def save(self) -> None:
        if self._dir and self._dirty:
            np.savez(self._dir / "embeddings.npz", **self._mem)  # type: ignore[arg-type]  # numpy stubs
            self._dirty = False


class HybridSessionRetriever:
    """RealMem retriever over HybridMemory: sessions are groups, turn pairs are chunks."""

    def __init__(
        self,
        embedder: Embedder,
        config: HybridConfig,
        context_turns: int = 1,
        query_embedder: Embedder | None = None,
        ranker: LearnedRanker | None = None,
        ranker_costs: list[float] | None = None,
    ) -> None:
        self._ranker = ranker
        #: Per query, seconds the ranker added to the search (HybridMemory.ranker_seconds).
        self.ranker_costs = ranker_costs if ranker_costs is not None else []
        # Stored chunks may come from a cache; queries are always embedded live so latency is honest.
        inner = embedder.inner if isinstance(embedder, CachingEmbedder) else embedder
        self._memory = HybridMemory(embedder, config, query_embedder=LruEmbedder(query_embedder or inner))
        self._context_turns = context_turns

    def add_session(self, session: Session) -> None:
        chunks = session_chunks(session)
        self._memory.add_group(session.uuid, session.position, chunks)

    def _context(self, query: Query) -> list[str]:
        return list(query.session_user_turns[-self._context_turns :]) if self._context_turns else []

    def prepare(self, query: Query) -> None:
        # A live memory service embedded each earlier user turn when it arrived (its own view); the
        # query-side LRU keeps those vectors, so only the new turn is embedded on this turn's path.
        self._memory.embed_queries(self._context(query))

    def retrieve(self, query: Query, k: int) -> list[str]:
        context = self._context(query)
        if self._ranker is None:
            return [key for key, _ in self._memory.rank_groups(query.text, context, k)]
        ranked = self._memory.rank_groups(query.text, context, k, ranker=self._ranker)
        self.ranker_costs.append(self._memory.ranker_seconds)
        return [key for key, _ in ranked]


POLICIES = ("mars", "mars-ranker", "hybrid", "semantic", "bm25", "recent")


def make_retriever(
    policy: str,
    embedder: Embedder | None,
    query_embedder: Embedder | None = None,
    ranker_costs: list[float] | None = None,
) -> Retriever:
    """A fresh retriever (empty memory) for one persona; `query_embedder` embeds queries (default: embedder);
    `mars-ranker` (the packaged learned ranker over the mars fusion) appends its cost per query to
    `ranker_costs`."""
    from mars_tools.bench.realmem import RecentRetriever, SessionBM25Retriever

    if policy == "recent":
        return RecentRetriever()
    if policy == "bm25":
        return SessionBM25Retriever()
    if embedder is None:
        raise ValueError(f"policy {policy!r} needs an embedder")
    if policy == "mars":
        return HybridSessionRetriever(embedder, POLICY_CONFIGS["mars"], 3, query_embedder=query_embedder)
    if policy == "mars-ranker":
        ranker, why = load_ranker()
        if ranker is None:
            raise ValueError(f"policy mars-ranker: no usable ranker ({why})")
        return HybridSessionRetriever(
            embedder, POLICY_CONFIGS["mars"], 3, query_embedder, ranker, ranker_costs
        )
    if policy == "hybrid":
        return HybridSessionRetriever(embedder, POLICY_CONFIGS["hybrid"], 0, query_embedder=query_embedder)
    if policy == "semantic":
        return HybridSessionRetriever(embedder, POLICY_CONFIGS["semantic"], 0, query_embedder=query_embedder)
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
