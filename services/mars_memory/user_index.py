"""Each user's FAISS + BM25 index (paper Eq. 12, Table 6: what the state-conditioned candidate view is
selected from): a cache derived from Postgres, loaded on the user's first view after a start and caught up
by commit watermark before every use. A replica mostly sees the users of the partitions it owns, so indexes
shard with the Kafka partitions, but correctness never depends on who wrote what."""

from __future__ import annotations

import asyncio

import numpy as np
from mars.domain.memory_policy import MemoryRecord
from mars.retrieval.hybrid import HybridConfig, HybridMemory

from mars_memory.embedding import MemoryEmbedding
from mars_memory.postgres_store import PostgresStore, StoredPair


class UserIndex:
    """One user's derived retrieval index: every record of the user up to `record_no` (its watermark,
    the highest commit_no it holds). Built from Postgres on first use, then caught up before each use."""

    def __init__(self, memory: HybridMemory, sessions: HybridMemory | None = None) -> None:
        self.memory = memory
        #: The same records grouped by session (one lexical document and centroid per session, as `mars
        #: bench realmem` indexes them), for the view's logged session ranking; None when it is off.
        self.sessions = sessions
        self.records: dict[str, MemoryRecord] = {}
        self.thread_of: dict[str, str] = {}
        self.order: list[str] = []  # record ids in commit order
        self.record_no = 0
        #: Serialises this user's index writes (catch-up) and searches, which run on worker threads.
        self.lock = asyncio.Lock()

    def add(self, record: MemoryRecord, thread_id: str, vectors: np.ndarray | None, record_no: int) -> None:
        if record.record_id not in self.memory:
            self.memory.add_group(record.record_id, record.seq, [record.text], vectors)
            if self.sessions is not None:
                self.sessions.extend_group(record.session_id, record.seq, [record.text], vectors)
            self.records[record.record_id] = record
            self.thread_of[record.record_id] = thread_id
            self.order.append(record.record_id)
        self.record_no = max(self.record_no, record_no)


class UserIndexes:
    """The UserIndex of every user this process has served since it started, by (tenant, user_id).
    `config` is the policy's fusion (the memories' own); `use_gpu` puts their FAISS indexes on a GPU;
    `with_sessions` also groups each user's records by session (the view's logged session ranking)."""

    def __init__(
        self,
        postgres: PostgresStore,
        embedding: MemoryEmbedding,
        config: HybridConfig,
        use_gpu: bool,
        with_sessions: bool,
    ) -> None:
        self._postgres = postgres
        self._embedding = embedding
        self._config = config
        self._use_gpu = use_gpu
        self._with_sessions = with_sessions
        self.by_user: dict[tuple[str, str], UserIndex] = {}

    def _new_memory(self) -> HybridMemory:
        embedding = self._embedding
        return HybridMemory(embedding.embedder, self._config, self._use_gpu, embedding.query_embedder)

    def get(self, tenant: str, user_id: str) -> UserIndex:
        """The user's cached index (empty the first time): `catch_up` with `index.lock` held before using
        it."""
        key = (tenant, user_id)
        index = self.by_user.get(key)
        if index is None:
            sessions = self._new_memory() if self._with_sessions else None
            index = self.by_user.setdefault(key, UserIndex(self._new_memory(), sessions))
        return index

    def pop(self, tenant: str, user_id: str) -> UserIndex | None:
        return self.by_user.pop((tenant, user_id), None)

    async def catch_up(self, tenant: str, user_id: str, index: UserIndex) -> None:
        """Load the records committed after the index's watermark (call with index.lock held).

        Any replica may have applied the user's writes (the view and writer consumer groups are assigned
        independently, and a rebalance moves users between replicas), so the index follows the table, not
        this process's own commits. A view that waited for applied seq n-1 finds turn n-1 searchable,
        since the record and the applied mark are committed in one transaction."""
        await self.add(index, await self._postgres.records_after(tenant, user_id, index.record_no))

    async def add(self, index: UserIndex, pairs: list[StoredPair]) -> None:
        """Records read from Postgres into the index, with their vectors (call with index.lock held)."""
        if not pairs:
            return
        loaded = []
        for pair in pairs:
            vectors = await self._embedding.vectors_of(pair.record, pair.embedding, pair.embedding_model)
            loaded.append((pair.record, pair.thread_id, vectors, pair.commit_no))

        # Index writes on a worker thread too (FAISS adds), never beside a search: the lock is held.
        def add_all() -> None:
            for item in loaded:
                index.add(*item)

        await asyncio.to_thread(add_all)
