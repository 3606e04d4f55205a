"""The index side of hybrid memory: one owner's groups (a session, or a thread) of chunks, each group one
lexical document (BM25) and its pieces' vectors (FAISS) with their centroid. What a query does with them,
the fusion, is mars.retrieval.hybrid's; this module only adds and keeps them consistent as groups grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mars.domain.bm25 import BM25Index
from mars.retrieval.dense import DenseIndex
from mars.retrieval.embedder import Embedder


@dataclass
class Group:
    key: str
    #: Where the group stands in time (a later group is more recent: the recency prior and tie-breaks).
    position: int
    chunk_ids: list[int] = field(default_factory=list)


class GroupIndex:
    """Groups of chunks under three indexes kept in step: BM25 over each group's whole text, FAISS over
    its pieces (the chunks as embedded, long ones split), and a centroid per group. Group i is document i
    of the lexical index and row i of the centroids. With `embedder=None` only the lexical index exists."""

    def __init__(
        self, embedder: Embedder | None, use_gpu: bool = False, bm25_k1: float = 1.2, bm25_b: float = 0.75
    ) -> None:
        self._embedder = embedder
        self._dense = DenseIndex(embedder.dim, use_gpu) if embedder is not None else None
        self.lexical = BM25Index(k1=bm25_k1, b=bm25_b)
        self.groups: list[Group] = []
        self._group_index: dict[str, int] = {}
        #: Per chunk id (a FAISS id), the group it belongs to.
        self._chunk_group: list[int] = []
        self.chunk_texts: list[str] = []
        self._centroid_rows: list[np.ndarray] = []
        #: Per group, the sum of its piece vectors (its centroid's direction, kept for `extend`).
        self._vector_sums: list[np.ndarray] = []
        self._centroids: np.ndarray | None = None  # stacked lazily; appends stay O(1)

    @property
    def dense(self) -> bool:
        return self._dense is not None

    def __len__(self) -> int:
        return len(self.groups)

    def __contains__(self, key: str) -> bool:
        return key in self._group_index

    def index_of(self, key: str) -> int | None:
        return self._group_index.get(key)

    @property
    def dense_vectors(self) -> int:
        return len(self._dense) if self._dense is not None else 0

    @property
    def lexical_docs(self) -> int:
        return len(self.lexical)

    def add(
        self, key: str, position: int, document: str, pieces: Sequence[str], vectors: np.ndarray | None
    ) -> None:
        """A new group: `document` its lexical text, `pieces` what is embedded (`vectors` when given)."""
        gi = len(self.groups)
        self.groups.append(Group(key, position))
        self._group_index[key] = gi
        self.lexical.add(document)
        if self._embedder is None or self._dense is None:
            return
        self._centroid_rows.append(np.zeros(self._embedder.dim, np.float32))
        self._vector_sums.append(np.zeros(self._embedder.dim, np.float64))
        self._add_pieces(gi, pieces, vectors)

    def extend(
        self, key: str, position: int, more_text: str, pieces: Sequence[str], vectors: np.ndarray | None
    ) -> None:
        """Group `key` (added already) grows by `more_text` and its pieces; its position becomes `position`
        when later."""
        gi = self._group_index[key]
        group = self.groups[gi]
        group.position = max(group.position, position)
        self.lexical.extend(gi, more_text)
        if self._embedder is None or self._dense is None:
            return
        self._add_pieces(gi, pieces, vectors)

    def _add_pieces(self, gi: int, pieces: Sequence[str], vectors: np.ndarray | None) -> None:
        assert self._embedder is not None and self._dense is not None
        if not pieces:
            return
        self._centroids = None
        vecs = vectors if vectors is not None else self._embedder.encode(pieces)
        # The centroid is the normalised mean of every piece of the group so far (computed from these
        # pieces alone when they are the first, exactly as before groups could grow).
        first = not self.groups[gi].chunk_ids
        self._vector_sums[gi] = self._vector_sums[gi] + vecs.astype(np.float64).sum(axis=0)
        centroid = vecs.mean(axis=0) if first else self._vector_sums[gi]
        centroid = centroid / max(float(np.linalg.norm(centroid)), 1e-9)
        self._centroid_rows[gi] = centroid.astype(np.float32)
        ids = np.arange(len(self.chunk_texts), len(self.chunk_texts) + len(pieces), dtype=np.int64)
        self._dense.add(ids, vecs)
        group = self.groups[gi]
        for cid, text in zip(ids.tolist(), pieces, strict=True):
            group.chunk_ids.append(cid)
            self._chunk_group.append(gi)
            self.chunk_texts.append(text)

    def centroids(self) -> np.ndarray | None:
        """Every group's centroid, one row per group (the same array until a piece is added); None
        without dense search."""
        if self._centroid_rows and self._centroids is None:
            self._centroids = np.stack(self._centroid_rows)
        return self._centroids

    def chunk_bests(self, qvecs: np.ndarray, means: bool) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Per query vector, each group's best chunk similarity (-inf for a group without chunks), and with
        `means` each group's mean chunk similarity to the first vector; None when no chunk is indexed."""
        if self._dense is None or len(self._dense) == 0:
            return None
        sims, ids = self._dense.search_many(qvecs, len(self._dense))
        chunk_group = np.asarray(self._chunk_group, dtype=np.int64)
        best = np.full((len(qvecs), len(self.groups)), -np.inf)
        for qi in range(len(qvecs)):
            valid = ids[qi] >= 0
            np.maximum.at(best[qi], chunk_group[ids[qi][valid]], sims[qi][valid].astype(np.float64))
        if not means:
            return best, None
        valid = ids[0] >= 0
        groups = chunk_group[ids[0][valid]]
        total = np.bincount(groups, sims[0][valid].astype(np.float64), len(self.groups))
        counts = np.bincount(groups, minlength=len(self.groups))
        return best, total / np.maximum(counts, 1)
