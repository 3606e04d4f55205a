"""The memory's embedding model, in two sessions: stored pairs' chunk vectors (in the commit, behind it, or
for a loaded record that has none of this model's) and queries' vectors (a cache that a view's prefetch,
or the state controller's vector of the turn, fills)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

import numpy as np
from mars import metrics
from mars.domain.memory_policy import MemoryRecord
from mars.domain.vectors import decode_vector
from mars.retrieval.embedder import Embedder, LruEmbedder, split_sessions
from mars.retrieval.hybrid import chunk_pieces
from mars.telemetry import step

from mars_memory.settings import MemorySettings
from mars_memory.write_behind import StoreVectors, WriteBehind

log = logging.getLogger(__name__)


class MemoryEmbedding:
    """`embedder` None: the model could not load, and views are served from BM25 alone. `model_name` tags
    stored vectors (embedder_tag); `max_chunk_words` splits a pair into pieces as HybridMemory does;
    `store_vectors` writes vectors embedded after their record was committed."""

    def __init__(
        self,
        embedder: Embedder | None,
        model_name: str,
        settings: MemorySettings,
        max_chunk_words: int,
        store_vectors: StoreVectors,
    ) -> None:
        #: Stored pairs' session of the model (None without a model).
        self.embedder = embedder
        # Queries get a session of their own: a view never waits behind a stored turn's embedding.
        self.query_embedder: LruEmbedder | None = None
        if embedder is not None:
            self.embedder, queries = split_sessions(embedder)
            self.query_embedder = LruEmbedder(queries)
        self.model_name = model_name
        self._settings = settings
        self._max_chunk_words = max_chunk_words
        self._store_vectors = store_vectors
        #: Query embeddings being computed, by text: a view awaits the one its prefetch started.
        self._embedding: dict[str, asyncio.Future[np.ndarray]] = {}
        #: Stored pairs embedded behind their commit (None: each in its commit, before it is applied).
        self.write_behind: WriteBehind | None = None
        if embedder is not None and settings.embed_behind > 0:
            self.write_behind = WriteBehind(self.embed_records, store_vectors, settings.embed_behind)
            metrics.watch_write_behind(self.write_behind)

    @property
    def dense_available(self) -> bool:
        return self.embedder is not None

    def forget(self, tenant: str, user_id: str) -> None:
        """Drop every cached query vector (which texts were the user's is not known where their index is
        not loaded here, and a turn asked with remember=false left a query and no record) and the user's
        pairs waiting behind their commit."""
        if self.query_embedder is not None:
            self.query_embedder.clear()
        if self.write_behind is not None:
            self.write_behind.forget((tenant, user_id))

    def embed_records(self, records: Sequence[MemoryRecord]) -> list[np.ndarray]:
        """Each record's chunk vectors (as HybridMemory.add_group stores them), from one call of the model."""
        assert self.embedder is not None
        pieces = [chunk_pieces([r.text], self._max_chunk_words) for r in records]
        vectors = self.embedder.encode([p for ps in pieces for p in ps])
        bounds = np.cumsum([0] + [len(ps) for ps in pieces])
        return [vectors[a:b] for a, b in itertools.pairwise(bounds)]

    def embed_record(self, record: MemoryRecord) -> np.ndarray | None:
        return self.embed_records([record])[0] if self.embedder is not None else None

    async def vectors_of(
        self, record: MemoryRecord, blob: bytes | None, model: str | None
    ) -> np.ndarray | None:
        """A loaded record's vectors: as stored (`blob`, computed by `model`), from the write-behind
        embedding under way, or (stored by another model, or by none) embedded here and stored back."""
        if self.embedder is None:
            return None
        if blob is not None and model == self.model_name:
            return np.frombuffer(blob, dtype=np.float32).reshape(-1, self.embedder.dim)
        pending = self.write_behind.pending(record.record_id) if self.write_behind else None
        if blob is None and pending is not None:
            with step("memory wait-write-behind"):
                try:
                    return await asyncio.shield(pending)
                except Exception:
                    pass  # it failed behind: embedded here
        vectors = (await asyncio.to_thread(self.embed_records, [record]))[0]
        await self._store_vectors([(record.record_id, vectors)])
        return vectors

    async def query_vector(self, text: str) -> None:
        """Put the query's vector in the query cache, or wait for the computation already under way."""
        if self.query_embedder is None:
            return
        pending = self._embedding.get(text)
        if pending is None:
            task: asyncio.Future[np.ndarray] = asyncio.ensure_future(
                asyncio.to_thread(self.query_embedder.encode, [text])
            )
            task.add_done_callback(lambda _: self._embedding.pop(text, None))
            self._embedding[text] = task
            pending = task
        await asyncio.shield(pending)

    def accept_query_embedding(self, text: str, tag: str, encoded: str) -> bool:
        """Hold the state controller's embedding of the turn's text as the query's vector, so each turn is
        embedded once. False where it cannot serve here (none given, another model, a bad vector): the
        view then embeds the text itself."""
        if not encoded or self.query_embedder is None:
            return False
        if tag != self.model_name:
            log.debug("turn embedding of %s, not %s: embedded again here", tag, self.model_name)
            return False
        try:
            vector = decode_vector(encoded)
        except ValueError as exc:
            log.warning("turn embedding not used (%s): embedded again here", exc)
            return False
        if vector.shape[0] != self.query_embedder.dim:
            dims = (vector.shape[0], self.query_embedder.dim)
            log.warning("turn embedding of %d dimensions, not %d: embedded again here", *dims)
            return False
        self.query_embedder.put(text, vector)
        return True

    def query_embedding(self, text: str) -> list[float]:
        """The query's vector (cached: a view that retrieved already embedded it), [] without an embedder."""
        if self.query_embedder is None or not self._settings.view_query_embedding:
            return []
        return [float(v) for v in self.query_embedder.encode([text])[0]]
