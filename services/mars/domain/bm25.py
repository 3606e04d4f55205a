"""Okapi BM25 over tokenize(); per-user corpora are small, so a pure-Python inverted index is enough."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from mars.domain.text import tokenize


class BM25Index:
    """Okapi BM25 (k1=1.5, b=0.75) with the non-negative idf variant log(1 + (N - n + 0.5) / (n + 0.5))."""

    def __init__(self, docs: Sequence[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1 = k1
        self.b = b
        self._tfs: list[Counter[str]] = [Counter(tokenize(d)) for d in docs]
        self._lens: list[int] = [sum(tf.values()) for tf in self._tfs]
        self.n_docs = len(self._tfs)
        self.avgdl = (sum(self._lens) / self.n_docs) if self.n_docs else 0.0
        df: Counter[str] = Counter()
        self._postings: dict[str, list[int]] = {}
        for i, tf in enumerate(self._tfs):
            for term in tf:
                df[term] += 1
                self._postings.setdefault(term, []).append(i)
        # The +1 inside the log keeps idf positive even for terms present in every document.
        self._idf: dict[str, float] = {
            t: math.log(1.0 + (self.n_docs - n + 0.5) / (n + 0.5)) for t, n in df.items()
        }

    def __len__(self) -> int:
        return self.n_docs

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Top-k (doc index, score) with score > 0, sorted by score desc, ties by lower doc index."""
        if k <= 0 or not self.n_docs:
            return []
        scores: dict[int, float] = {}
        avgdl = self.avgdl or 1.0
        for term in set(tokenize(query)):
            idf = self._idf.get(term)
            if idf is None:
                continue
            for i in self._postings[term]:
                tf = self._tfs[i][term]
                norm = tf + self.k1 * (1.0 - self.b + self.b * self._lens[i] / avgdl)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1.0) / norm
        ranked = sorted(((i, s) for i, s in scores.items() if s > 0.0), key=lambda p: (-p[1], p[0]))
        return ranked[:k]
