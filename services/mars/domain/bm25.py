"""Okapi BM25 over tokenize() with an incremental inverted index: documents are appended as memory grows
and idf / average length always reflect the memory added so far (as in a live system)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from mars.domain.text import tokenize


class BM25Index:
    """Okapi BM25 with the non-negative idf variant log(1 + (N - n + 0.5) / (n + 0.5))."""

    def __init__(
        self,
        docs: Sequence[str] = (),
        k1: float = 1.5,
        b: float = 0.75,
        tokenizer: Callable[[str], list[str]] = tokenize,
    ) -> None:
        self.k1 = k1
        self.b = b
        self._tokenize = tokenizer
        self._tfs: list[Counter[str]] = []
        self._lens: list[int] = []
        self._total_len = 0
        self._df: Counter[str] = Counter()
        self._postings: dict[str, list[int]] = {}
        for d in docs:
            self.add(d)

    def __len__(self) -> int:
        return len(self._tfs)

    @property
    def n_docs(self) -> int:
        return len(self._tfs)

    @property
    def avgdl(self) -> float:
        return self._total_len / self.n_docs if self.n_docs else 0.0

    def add(self, doc: str) -> int:
        """Append a document; returns its index."""
        tf = Counter(self._tokenize(doc))
        i = len(self._tfs)
        self._tfs.append(tf)
        length = sum(tf.values())
        self._lens.append(length)
        self._total_len += length
        for term in tf:
            self._df[term] += 1
            self._postings.setdefault(term, []).append(i)
        return i

    def extend(self, i: int, text: str) -> None:
        """Append `text` to document `i` (a session growing turn by turn): the same index as adding the
        whole document at once."""
        more = Counter(self._tokenize(text))
        tf = self._tfs[i]
        for term, count in more.items():
            if term not in tf:
                self._df[term] += 1
                self._postings.setdefault(term, []).append(i)
            tf[term] += count
        length = sum(more.values())
        self._lens[i] += length
        self._total_len += length

    def presence(self, terms: Sequence[str], docs: Sequence[int]) -> np.ndarray:
        """(terms x docs) booleans: which of documents `docs` holds which term."""
        out = np.zeros((len(terms), len(docs)), dtype=bool)
        row = {term: j for j, term in enumerate(terms)}
        for col, i in enumerate(docs):
            for term in row.keys() & self._tfs[i].keys():  # C-level, over the few terms asked
                out[row[term], col] = True
        return out

    def doc_length(self, i: int) -> int:
        return self._lens[i]

    def idf(self, term: str) -> float:
        n = self._df.get(term, 0)
        # The +1 inside the log keeps idf positive even for terms present in every document.
        return math.log(1.0 + (self.n_docs - n + 0.5) / (n + 0.5)) if n else 0.0

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document sharing a term with the query."""
        scores: dict[int, float] = {}
        avgdl = self.avgdl or 1.0
        for term in set(self._tokenize(query)):
            postings = self._postings.get(term)
            if not postings:
                continue
            idf = self.idf(term)
            for i in postings:
                tf = self._tfs[i][term]
                norm = tf + self.k1 * (1.0 - self.b + self.b * self._lens[i] / avgdl)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1.0) / norm
        return scores

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """Top-k (doc index, score) with score > 0, sorted by score desc, ties by lower doc index."""
        if k <= 0 or not self.n_docs:
            return []
        ranked = sorted(
            ((i, s) for i, s in self.scores(query).items() if s > 0.0), key=lambda p: (-p[1], p[0])
        )
        return ranked[:k]
