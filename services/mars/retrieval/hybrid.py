"""Hybrid memory of one owner: dense chunk search (FAISS) + lexical group search (BM25), fused.

Memory is stored as *groups* (a session, or a thread) of *chunks* (turn pairs, split when long). A query
ranks groups: the dense side scores a group by its best chunks, the lexical side by BM25 over the group's
whole text; the rankings are fused (reciprocal rank or weighted scores) and a recency prior is added,
since memory a user needs again is more often recent. Chunks of the top groups are what a view exposes.
The groups and their indexes are mars.retrieval.group_index; this module is the query side, the fusion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Literal

import numpy as np

from mars.retrieval.embedder import Embedder
from mars.retrieval.fusion import reciprocal_rank_fusion, weighted_score_fusion
from mars.retrieval.group_index import GroupIndex
from mars.retrieval.ranker import (
    CANDIDATES,
    GroupSignals,
    LearnedRanker,
    candidate_features,
    coverage,
    query_terms,
)


def split_words(text: str, max_words: int = 160, overlap: int = 32) -> list[str]:
    """Windows of at most max_words words; long texts are chunked with overlap, never silently cut."""
    words = text.split()
    if len(words) <= max_words:
        return [text] if words else []
    step = max(1, max_words - overlap)
    out = []
    for start in range(0, len(words), step):
        out.append(" ".join(words[start : start + max_words]))
        if start + max_words >= len(words):
            break
    return out


def chunk_pieces(chunks: Sequence[str], max_words: int) -> list[str]:
    """The texts actually embedded for `chunks` (long chunks split into windows)."""
    return [p for c in chunks for p in split_words(c, max_words)]


def embed_chunks(embedder: Embedder, chunks: Sequence[str], max_words: int) -> np.ndarray:
    """Vectors for `chunks` exactly as HybridMemory.add_group stores them (to persist beside the text)."""
    return embedder.encode(chunk_pieces(chunks, max_words))


@dataclass(frozen=True)
class HybridConfig:
    fusion: Literal["rrf", "weighted"] = "rrf"
    rrf_k: float = 60.0
    dense_weight: float = 1.0
    lexical_weight: float = 1.0
    #: Weight of the recency prior (reciprocal rank of the group by recency, fused like a third ranker).
    recency_weight: float = 0.0
    #: Weight of the secondary query texts (e.g. the previous user turn) relative to the query itself.
    context_weight: float = 0.0
    #: Pseudo-relevance feedback: groups whose centroid is close to the top `prf_top` groups' centroids
    #: are fused in as another ranking (multi-session work shares vocabulary and embeddings).
    prf_weight: float = 0.0
    prf_top: int = 2
    #: Weight of a ranking by query similarity to each group's centroid (the group's overall topic).
    centroid_weight: float = 0.0
    bm25_k1: float = 1.2
    bm25_b: float = 0.75
    max_chunk_words: int = 160


class HybridMemory:
    """Groups ranked for a query by fusing their dense, lexical, recency, topical (centroid) and feedback
    rankings; the groups themselves are `index` (mars.retrieval.group_index). With `embedder=None` the
    memory is lexical only (the degraded mode when no embedder can load)."""

    def __init__(
        self,
        embedder: Embedder | None,
        config: HybridConfig | None = None,
        use_gpu: bool = False,
        query_embedder: Embedder | None = None,
    ) -> None:
        self.config = config or HybridConfig()
        # Queries may use a different (uncached) embedder than stored chunks, e.g. in benchmarks.
        self._query_embedder = query_embedder or embedder
        self.index = GroupIndex(embedder, use_gpu, bm25_k1=self.config.bm25_k1, bm25_b=self.config.bm25_b)
        #: What the ranker added to the last ranked search (signals, features, model): its cost per view.
        self.ranker_seconds = 0.0

    @property
    def dense(self) -> bool:
        return self.index.dense

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    @property
    def dense_vectors(self) -> int:
        return self.index.dense_vectors

    @property
    def lexical_docs(self) -> int:
        return self.index.lexical_docs

    def add_group(
        self, key: str, position: int, chunks: Sequence[str], vectors: np.ndarray | None = None
    ) -> None:
        """Add one group with its chunk texts (split when long); `vectors` (from embed_chunks) skips embedding."""
        if key in self.index:
            raise ValueError(f"group {key!r} already added")
        self.index.add(key, position, "\n".join(chunks), self._pieces(key, chunks, vectors), vectors)

    def extend_group(
        self, key: str, position: int, chunks: Sequence[str], vectors: np.ndarray | None = None
    ) -> None:
        """Append chunks to group `key` (added when new): a session growing turn by turn ranks exactly
        as the whole session added at once (same lexical document, same pieces, same centroid); its
        position becomes `position` when later."""
        if key not in self.index:
            self.add_group(key, position, chunks, vectors)
            return
        # Pieces matter to the dense side only: a lexical-only memory neither splits nor checks them.
        pieces = self._pieces(key, chunks, vectors) if self.index.dense else []
        self.index.extend(key, position, "\n" + "\n".join(chunks), pieces, vectors)

    def _pieces(self, key: str, chunks: Sequence[str], vectors: np.ndarray | None) -> list[str]:
        pieces = chunk_pieces(chunks, self.config.max_chunk_words)
        if vectors is not None and len(vectors) != len(pieces):
            raise ValueError(f"group {key!r}: {len(vectors)} vectors for {len(pieces)} pieces")
        return pieces

    def embed_queries(self, texts: Sequence[str]) -> None:
        """Embed query texts ahead of use (a caching query embedder keeps them for later turns)."""
        if self._query_embedder is not None and texts:
            self._query_embedder.encode([t for t in texts if t.strip()])

    def _dense_bests(self, queries: Sequence[str], means: bool) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Per query text, each group's best chunk similarity (-inf for a group without chunks), and with
        `means` each group's mean chunk similarity to the first text; None without dense search."""
        if self._query_embedder is None or self.index.dense_vectors == 0:
            return None
        return self.index.chunk_bests(self._query_embedder.encode(queries), means)

    def rank_groups(
        self,
        query: str,
        context: Sequence[str] = (),
        k: int = 20,
        config: HybridConfig | None = None,
        exclude: Collection[str] = (),
        ranker: LearnedRanker | None = None,
    ) -> list[tuple[str, float]]:
        """Groups best first with fused scores; `context` holds secondary query texts (earlier turns);
        `config` overrides the memory's own fusion settings for this query (state-guided retrieval);
        `exclude` names groups ranked as if absent (no slot, no pull on recency or feedback); `ranker`
        re-orders the fused top CANDIDATES, which take the head's fused scores in falling order (scores
        still fall along the ranking, as packing and the view's load features expect, with the same
        bounds)."""
        if not self.index.groups:
            return []
        fusion = self._fuse(query, context, config or self.config, exclude, signals=ranker is not None)
        ordered = sorted(fusion.fused.items(), key=lambda kv: (-kv[1], -self.index.groups[kv[0]].position))
        if ranker is not None and len(ordered) > 1:
            started = time.perf_counter()
            head = ordered[:CANDIDATES]
            order = ranker.order(candidate_features(self._signals(fusion, [g for g, _ in head])))
            tail = ordered[CANDIDATES:]
            ordered = [(head[i][0], score) for i, (_, score) in zip(order, head, strict=True)] + tail
            self.ranker_seconds = time.perf_counter() - started
        return [(self.index.groups[g].key, s) for g, s in ordered[:k]]

    def candidates(
        self,
        query: str,
        context: Sequence[str] = (),
        n: int = CANDIDATES,
        config: HybridConfig | None = None,
        exclude: Collection[str] = (),
    ) -> GroupSignals | None:
        """The fused top-n groups with the signals behind their fusion (what a ranker learns from)."""
        if not self.index.groups:
            return None
        fusion = self._fuse(query, context, config or self.config, exclude, signals=True)
        ordered = sorted(fusion.fused.items(), key=lambda kv: (-kv[1], -self.index.groups[kv[0]].position))
        return self._signals(fusion, [g for g, _ in ordered[:n]])

    def _fuse(
        self, query: str, context: Sequence[str], cfg: HybridConfig, exclude: Collection[str], signals: bool
    ) -> _Fusion:
        """The fused scores of every group not excluded; `signals`: also the centroid and PRF similarities
        a ranker reads when the fusion itself does not use them."""
        texts = [query, *[c for c in context if c.strip()]]
        weights = [1.0] + [cfg.context_weight] * (len(texts) - 1)
        if cfg.context_weight == 0.0:
            texts, weights = texts[:1], weights[:1]
        gone = {g for g in map(self.index.index_of, exclude) if g is not None}
        bests = self._dense_bests(texts, means=signals)
        # The query's tokens serve its BM25 scores and then the ranker's lexical signals.
        lexical_index = self.index.lexical
        tokens = lexical_index.tokenize(texts[0])
        # An excluded group is absent from BM25's statistics too (idf, average length), so its scores are
        # those of a memory that never held it, as in the benches' replay.
        per_text = [
            lexical_index.token_scores(tokens, gone),
            *(lexical_index.scores(t, gone) for t in texts[1:]),
        ]
        dense_scores = _dense_group_scores(None if bests is None else bests[0], weights)
        dense = {g: v for g, v in dense_scores.items() if g not in gone}
        lexical = _lexical_group_scores(per_text, weights)  # excluded groups are unscored already
        kept = [g for g in range(len(self.index)) if g not in gone]
        by_recency = sorted(kept, key=lambda g: -self.index.groups[g].position)
        orders = None
        if cfg.fusion == "rrf":
            orders = _ranking(dense), _ranking(lexical)
            rankings = [*orders]
            ws = [cfg.dense_weight, cfg.lexical_weight]
            if cfg.recency_weight:
                rankings.append(by_recency)
                ws.append(cfg.recency_weight)
            fused = reciprocal_rank_fusion(rankings, ws, cfg.rrf_k)
        else:
            maps = [dense, lexical]
            ws = [cfg.dense_weight, cfg.lexical_weight]
            if cfg.recency_weight:
                maps.append({g: 1.0 / math.log2(2 + r) for r, g in enumerate(by_recency)})
                ws.append(cfg.recency_weight)
            fused = weighted_score_fusion(maps, ws)
        centroids = self.index.centroids() if signals or cfg.prf_weight or cfg.centroid_weight else None
        topical = None
        if (signals or cfg.centroid_weight) and centroids is not None and self._query_embedder is not None:
            topical = centroids @ self._query_embedder.encode(texts[:1])[0]
        if cfg.centroid_weight and topical is not None:
            by_topic = _ranking({g: float(v) for g, v in enumerate(topical) if g not in gone})
            for g, v in reciprocal_rank_fusion([by_topic], [cfg.centroid_weight], cfg.rrf_k).items():
                fused[g] = fused.get(g, 0.0) + v
        prf = None
        if (signals or cfg.prf_weight) and fused and centroids is not None:
            top = sorted(fused, key=lambda g: -fused[g])[: cfg.prf_top]
            prf = (centroids @ centroids[top].T).max(axis=1)
            if cfg.prf_weight:
                # The top groups lead, in their fused order: each one's similarity is its own, exactly 1, and
                # the product's rounding (which differs between BLAS kernels and CPUs) must not order that
                # tie, or the fused ranking would move with the CPU.
                leading = set(top)
                prf_ranking = [*top, *_ranking({g: float(prf[g]) for g in kept if g not in leading})]
                extra = reciprocal_rank_fusion([prf_ranking], [cfg.prf_weight], cfg.rrf_k)
                for g, v in extra.items():
                    fused[g] = fused.get(g, 0.0) + v
        return _Fusion(texts, tokens, bests, per_text, dense, lexical, orders, by_recency, fused, topical, prf, gone)

    def _signals(self, fusion: _Fusion, groups: Sequence[int]) -> GroupSignals:
        """GroupSignals of `groups` (fused order) under `fusion`: gathered from arrays over all groups, a few
        array operations whatever the number of candidates (this runs on every ranked view)."""
        # The groups the query was ranked among: an excluded group (the live turn's own session) is absent,
        # so the pipeline's features are those of a memory that never held it, as in the benches' replay.
        n_groups, n = len(fusion.by_recency), len(groups)
        idx = np.asarray(groups, dtype=np.int64)
        # Ranks by score, best first, as the fusion ranked them (a stable sort: a tie's order is not a
        # feature); rank n_groups for a group absent from a ranking.
        orders = fusion.orders or (_ranking(fusion.dense), _ranking(fusion.lexical))
        ranks = np.full((3, len(self.index)), float(n_groups))
        for row, order in enumerate((*orders, fusion.by_recency)):
            ranks[row, order] = np.arange(len(order), dtype=np.float64)
        ranks = ranks[:, idx]
        # Per group: best chunk similarity to the query, mean chunk similarity, centroid and PRF similarity.
        dense = np.zeros((4, n))
        dense[0] = -1.0
        if fusion.bests is not None:
            dense[0] = fusion.bests[0][0][idx]
            if fusion.bests[1] is not None:
                dense[1] = fusion.bests[1][idx]
        if fusion.topical is not None:
            dense[2] = fusion.topical[idx]
        if fusion.prf is not None:
            dense[3] = fusion.prf[idx]
        dense = np.where(np.isfinite(dense), dense, 0.0)
        tokens = fusion.query_tokens
        lexical_index, centroids = self.index.lexical, self.index.centroids()
        terms = query_terms(fusion.texts[0], tokens, lexical_index.idfs(set(tokens), fusion.gone))
        lexical_query, fused, group_list = fusion.lexical_texts[0], fusion.fused, self.index.groups
        return GroupSignals(
            keys=[group_list[g].key for g in groups],
            n_groups=n_groups,
            has_context=len(fusion.texts) > 1,
            dense_query=dense[0],
            dense_mean=dense[1],
            lexical_query=np.fromiter(map(lexical_query.get, groups, repeat(0.0)), np.float64, n),
            fused=np.fromiter(map(fused.__getitem__, groups), np.float64, n),
            dense_rank=ranks[0],
            lexical_rank=ranks[1],
            recency_rank=ranks[2],
            centroid=dense[2],
            prf=dense[3],
            chunks=np.fromiter((len(group_list[g].chunk_ids) for g in groups), np.float64, n),
            doc_length=lexical_index.doc_lengths(groups),
            coverage=coverage(terms, lambda words: lexical_index.presence(words, idx), n),
            centroids=centroids[idx] if centroids is not None else np.zeros((n, 0)),
        )


@dataclass
class _Fusion:
    """One query's fusion and what went into it (group indexes)."""

    texts: list[str]
    #: The query's (first text's) tokens as the lexical index tokenises them.
    query_tokens: list[str]
    #: (best chunk similarity per text and group, mean chunk similarity to the query per group when the
    #: signals were asked for).
    bests: tuple[np.ndarray, np.ndarray | None] | None
    lexical_texts: list[dict[int, float]]
    dense: dict[int, float]
    lexical: dict[int, float]
    #: The dense and lexical groups best first (`_ranking`), when the fusion ranked them (reciprocal rank).
    orders: tuple[list[int], list[int]] | None
    by_recency: list[int]
    fused: dict[int, float]
    topical: np.ndarray | None
    prf: np.ndarray | None
    #: The excluded groups.
    gone: set[int]


def state_conditioned(config: HybridConfig, prefer_recent: bool) -> HybridConfig:
    """The fusion a state asks for: prefer_recent strengthens the recency prior (paper Table 6)."""
    return replace(config, recency_weight=config.recency_weight * 1.5) if prefer_recent else config


def _dense_group_scores(best: np.ndarray | None, qweights: Sequence[float]) -> dict[int, float]:
    """Each group's dense score: its best chunk's similarity per query text, summed by the texts' weights."""
    if best is None:
        return {}
    total = np.zeros(best.shape[1], dtype=np.float64)
    seen = np.zeros(best.shape[1], dtype=bool)
    for qi, w in enumerate(qweights):
        # A group is as relevant as its best chunk; query texts are combined by weight.
        hit = np.isfinite(best[qi])
        total[hit] += w * best[qi][hit]
        seen |= hit
    return {int(g): float(total[g]) for g in np.flatnonzero(seen)}


def _lexical_group_scores(
    per_text: Sequence[dict[int, float]], qweights: Sequence[float]
) -> dict[int, float]:
    """Each group's BM25 score per query text, summed by the texts' weights."""
    scores: dict[int, float] = {}
    for text_scores, w in zip(per_text, qweights, strict=True):
        for g, s in text_scores.items():
            scores[g] = scores.get(g, 0.0) + w * s
    return scores


def _ranking(scores: dict[int, float]) -> list[int]:
    return [g for g, _ in sorted(scores.items(), key=lambda kv: -kv[1])]


#: Named policies (paper Table 17 ablations), shared by the memory service and `mars bench realmem`.
#: `mars` was tuned on the 7 RealMem personas: dense + BM25 + recency prior, centroid pseudo-relevance
#: feedback, a group-centroid topical ranking, and the conversation's recent user turns as secondary queries.
POLICY_CONFIGS: dict[str, HybridConfig] = {
    "mars": HybridConfig(
        recency_weight=1.0, prf_weight=1.0, prf_top=3, context_weight=0.3, rrf_k=30.0, centroid_weight=0.5
    ),
    "hybrid": HybridConfig(),
    "semantic": HybridConfig(lexical_weight=0.0),
    "bm25": HybridConfig(dense_weight=0.0),
}
