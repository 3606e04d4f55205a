"""Okapi BM25 over tokenize() with an incremental inverted index: documents are appended as memory grows
and idf / average length always reflect the memory added so far (as in a live system)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

from mars.domain.text import tokenize

_NO_POSTINGS = np.zeros(0, dtype=np.int64)


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
        #: Postings as arrays (`presence`), built when a term is first asked for and dropped whenever its
        #: postings grow (a document added or extended with the term), so they always equal `_postings`.
        self._posting_arrays: dict[str, np.ndarray] = {}
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
            self._posting_arrays.pop(term, None)
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
                self._posting_arrays.pop(term, None)
            tf[term] += count
        length = sum(more.values())
        self._lens[i] += length
        self._total_len += length

    def presence(self, terms: Sequence[str], docs: Sequence[int] | np.ndarray) -> np.ndarray:
        """(terms x docs) booleans: which of documents `docs` holds which term. Read from the terms'
        postings in a few array operations, whatever the number of terms and documents asked about."""
        n = len(docs)
        if not len(terms) or not n:
            return np.zeros((len(terms), n), dtype=bool)
        wanted = np.asarray(docs, dtype=np.int64)
        # Each document's column among `docs`; column n (dropped) for every other document.
        column = np.full(self.n_docs, n, dtype=np.int64)
        column[wanted] = np.arange(n)
        cached = self._posting_arrays
        arrays = [a if (a := cached.get(term)) is not None else self._posting_array(term) for term in terms]
        starts = np.arange(0, len(arrays) * (n + 1), n + 1)
        cells = np.repeat(starts, np.fromiter(map(len, arrays), np.int64, len(arrays)))
        cells += column[np.concatenate(arrays)]
        out = np.zeros(len(arrays) * (n + 1), dtype=bool)
        out[cells] = True
        # Gathered by each document's column: a document asked for twice answers in both its columns.
        # (`take` answers in C order, as a fresh array would be.)
        return out.reshape(len(arrays), n + 1).take(column[wanted], axis=1)

    def _posting_array(self, term: str) -> np.ndarray:
        """The term's postings as an array, cached (`presence` asks the cache first)."""
        postings = self._postings.get(term)
        if not postings:
            return _NO_POSTINGS
        array = self._posting_arrays[term] = np.asarray(postings, dtype=np.int64)
        return array

    def doc_length(self, i: int) -> int:
        return self._lens[i]

    def doc_lengths(self, docs: Sequence[int]) -> np.ndarray:
        """The lengths (in tokens) of documents `docs`, as floats."""
        lens = self._lens
        return np.fromiter((lens[i] for i in docs), np.float64, len(docs))

    def tokenize(self, text: str) -> list[str]:
        """`text` as this index tokenises documents and queries."""
        return self._tokenize(text)

    def idf(self, term: str) -> float:
        n = self._df.get(term, 0)
        # The +1 inside the log keeps idf positive even for terms present in every document.
        return math.log(1.0 + (self.n_docs - n + 0.5) / (n + 0.5)) if n else 0.0

    def idfs(self, terms: Iterable[str], excluded: Collection[int] = ()) -> dict[str, float]:
        """`idf` of each of `terms` (the same numbers, without a call per term); `excluded`: as if those
        documents were not in the index."""
        terms = set(terms)
        df, n, log = self._document_frequencies(terms, excluded), self.n_docs - len(excluded), math.log
        return {t: log(1.0 + (n - d + 0.5) / (d + 0.5)) if (d := df.get(t, 0)) else 0.0 for t in terms}

    def _document_frequencies(self, terms: set[str], excluded: Collection[int]) -> dict[str, int]:
        if not excluded:
            return self._df
        df = {t: self._df.get(t, 0) for t in terms}
        for i in excluded:
            for t in terms.intersection(self._tfs[i]):
                df[t] -= 1
        return df

    def scores(self, query: str, excluded: Collection[int] = ()) -> dict[int, float]:
        """BM25 score of every document sharing a term with the query."""
        return self.token_scores(self._tokenize(query), excluded)

    def token_scores(self, tokens: Sequence[str], excluded: Collection[int] = ()) -> dict[int, float]:
        """`scores` of a query already tokenised (by `tokenize`). `excluded` (document indexes, distinct)
        are scored as if absent from the index: no score, and not counted in idf or the average length (a
        live session ranked against the others scores them as a memory that never held it would)."""
        scores: dict[int, float] = {}
        total, n = self._total_len - sum(self._lens[i] for i in excluded), self.n_docs - len(excluded)
        avgdl = (total / n if n else 0.0) or 1.0
        idfs = self.idfs(tokens, excluded)
        for term, idf in idfs.items():
            postings = self._postings.get(term)
            if not postings or not idf:
                continue
            for i in postings:
                if i in excluded:
                    continue
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
