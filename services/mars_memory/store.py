"""The memory service's memory: turn pairs, threads and progress in Postgres, and each user's FAISS + BM25
index derived from them (paper Eq. 12, Table 6: the state-conditioned candidate view).

MemoryStore puts together what does the work, each in a module of its own: the SQL
(mars_memory.postgres_store), the embedding model (mars_memory.embedding), the users' indexes
(mars_memory.user_index), the view built from one (mars_memory.candidate_view) and the read-your-writes
wait (mars_memory.read_your_writes)."""

from __future__ import annotations

import asyncio
import uuid

from mars.db import pg_text
from mars.domain.memory_policy import MemoryRecord
from mars.retrieval.embedder import Embedder, embedder_tag
from mars.telemetry import step
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from psycopg_pool import AsyncConnectionPool

from mars_memory.candidate_view import CandidateViewBuilder, fusion_config
from mars_memory.embedding import MemoryEmbedding
from mars_memory.postgres_store import Pair, PostgresStore, ThreadRow
from mars_memory.read_your_writes import ReadYourWrites
from mars_memory.settings import MemorySettings
from mars_memory.user_index import UserIndex, UserIndexes


class MemoryStore:
    """Postgres-backed memory of one deployment; every query is scoped to (tenant, user_id).

    Postgres holds the records, threads and chunk vectors; the FAISS + BM25 index of each user is a
    cache derived from them (mars_memory.user_index), caught up by commit watermark before every use.
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: MemorySettings, embedder: Embedder | None
    ) -> None:
        self._settings = settings
        config = fusion_config(settings)
        model_name = embedder_tag(settings.embedding_model, settings.embedding_precision)
        self.postgres = PostgresStore(pool, model_name)
        self.embedding = MemoryEmbedding(
            embedder, model_name, settings, config.max_chunk_words, self.postgres.store_vectors
        )
        self.indexes = UserIndexes(
            self.postgres, self.embedding, config, settings.use_gpu, settings.view_ranking_depth > 0
        )
        self.views = CandidateViewBuilder(settings, config, self.embedding)
        self.read_your_writes = ReadYourWrites(self.postgres.applied_seq, settings.read_your_writes_wait_s)

    @property
    def dense_available(self) -> bool:
        return self.embedding.dense_available

    async def user_index(self, tenant: str, user_id: str) -> UserIndex:
        """The user's cached index (empty the first time): call `catch_up` with `index.lock` held before
        using it."""
        return self.indexes.get(tenant, user_id)

    async def catch_up(self, tenant: str, user_id: str, index: UserIndex) -> None:
        """Load the records committed after the index's watermark (call with index.lock held)."""
        await self.indexes.catch_up(tenant, user_id, index)

    async def forget(self, tenant: str, user_id: str) -> int:
        """Drop the user's index and every cached query vector (the user's rows are deleted from Postgres
        already: a later use rebuilds the index from what is left, nothing). Returns the records the index
        held. The whole query cache goes: which of its texts were this user's is not known where their
        index is not loaded here, and a turn asked with remember=false left a query and no record."""
        self.embedding.forget(tenant, user_id)
        self.read_your_writes.forget(tenant, user_id)
        index = self.indexes.pop(tenant, user_id)
        if index is None:
            return 0
        async with index.lock:  # a search in progress on it finishes first
            return len(index.records)

    async def describe(self, tenant: str, user_id: str) -> svc.IndexDescription:
        index = await self.user_index(tenant, user_id)
        async with index.lock:
            await self.catch_up(tenant, user_id, index)
            return svc.IndexDescription(
                record_ids=list(index.order),
                record_no=index.record_no,
                dense_vectors=index.memory.dense_vectors,
                lexical_docs=index.memory.lexical_docs,
                replica=self._settings.replica,
            )

    async def wait_applied(self, tenant: str, user_id: str, seq: int) -> bool:
        """True once seq is applied; False when the bounded read-your-writes wait ran out."""
        return await self.read_your_writes.wait(tenant, user_id, seq)

    async def view(
        self, tenant: str, user_id: str, text: str, state: ev.SessionState, session_id: str = ""
    ) -> ev.CandidateView:
        return (await self.view_after(tenant, user_id, text, state, after_seq=0, session_id=session_id))[0]

    async def view_after(
        self,
        tenant: str,
        user_id: str,
        text: str,
        state: ev.SessionState,
        after_seq: int,
        session_id: str = "",
    ) -> tuple[ev.CandidateView, bool]:
        """The view, and whether it holds every turn up to `after_seq` (read-your-writes: False when the
        bounded wait for them ran out). One round trip when they are applied already (the usual case):
        the applied seq, the records past the index's watermark and the active thread, pipelined."""
        index = await self.user_index(tenant, user_id)
        async with index.lock:
            with step("memory snapshot"):
                applied, active = await self._snapshot(tenant, user_id, index)
            if applied >= after_seq:
                return await self.views.build(index, text, state, active, session_id), True
        # Not applied yet: wait without holding the index, then read again.
        with step("memory wait-applied"):
            fresh = await self.wait_applied(tenant, user_id, after_seq)
        async with index.lock:
            with step("memory snapshot"):
                _, active = await self._snapshot(tenant, user_id, index)
            return await self.views.build(index, text, state, active, session_id), fresh

    async def _snapshot(self, tenant: str, user_id: str, index: UserIndex) -> tuple[int, ThreadRow | None]:
        """Catch the index up and read the applied seq and the active thread, in one round trip (call with
        index.lock held)."""
        applied, pairs, active = await self.postgres.snapshot(tenant, user_id, index.record_no)
        await self.indexes.add(index, pairs)
        return applied, active

    async def commit(self, event: ev.Generated) -> ev.MemoryCommitted:
        """Store the turn pair and advance the user's applied seq, in one transaction (idempotent by
        turn_id; mars_memory.postgres_store), then wake the views waiting for it."""
        turn = event.turn
        pair: Pair | None = None
        write_behind = self.embedding.write_behind
        behind = False
        if event.status == ev.OK and turn.options.get("remember") != "false":
            # Postgres refuses NUL in TEXT and JSONB: the turn is stored without it.
            query, answer = pg_text(event.query), pg_text(event.text)
            record = MemoryRecord(uuid.uuid4().hex, turn.session_id, turn.turn_id, turn.seq, query, answer)
            # Embedded behind the commit (mars_memory.write_behind), or, with the write-behind at its bound,
            # before the transaction: no connection (nor the user's lock) is held meanwhile.
            behind = write_behind is not None and not write_behind.full
            vectors = None if behind else await asyncio.to_thread(self.embedding.embed_record, record)
            pair = record, vectors
        out, redelivered = await self.postgres.commit(event, pair)
        # Indexes (this replica's and any other's) pick the record up from Postgres before their next use.
        # A redelivery's pair was stored (and submitted) the first time.
        if behind and not redelivered and pair is not None and write_behind is not None:
            write_behind.submit(pair[0], (turn.tenant, turn.user_id))
        await self.read_your_writes.committed(turn.tenant, turn.user_id, turn.seq)
        return out

    def accept_query_embedding(self, text: str, tag: str, encoded: str) -> bool:
        """The state controller's vector of the turn as its query vector (MemoryEmbedding's)."""
        return self.embedding.accept_query_embedding(text, tag, encoded)

    def query_embedding(self, text: str) -> list[float]:
        """The query's vector for the view event, [] without an embedder or when it is off."""
        return self.embedding.query_embedding(text)
