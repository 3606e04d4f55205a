"""Memory policies as RealMem retrievers: the same HybridMemory the memory service uses, fed the
benchmark's sessions in list order (only text, time and order inform retrieval)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mars.bench.realmem import Query, Session
from mars.retrieval.embedder import Embedder
from mars.retrieval.hybrid import HybridConfig, HybridMemory, split_words


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
        self._inner = inner
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
        return self._inner.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        keys = [hashlib.sha1(t.encode()).hexdigest() for t in texts]
        missing = [i for i, k in enumerate(keys) if k not in self._mem]
        if missing:
            vecs = self._inner.encode([texts[i] for i in missing])
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

    def __init__(self, embedder: Embedder, config: HybridConfig, context_turns: int = 1) -> None:
        self._memory = HybridMemory(embedder, config)
        self._embedder = embedder
        self._context_turns = context_turns

    def add_session(self, session: Session) -> None:
        chunks = [
            p for c in session_chunks(session) for p in split_words(c, self._memory.config.max_chunk_words)
        ]
        self._memory.add_group(session.uuid, session.position, chunks, self._embedder.encode(chunks))

    def retrieve(self, query: Query, k: int) -> list[str]:
        context = [query.previous_user_text] if query.previous_user_text and self._context_turns else []
        return [key for key, _ in self._memory.rank_groups(query.text, context, k)]
