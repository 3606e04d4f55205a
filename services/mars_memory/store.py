"""The memory service's persistence: turn pairs, threads and progress in Postgres, and each user's
FAISS + BM25 index derived from them (paper Eq. 12, Table 6: the state-conditioned candidate view)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mars import metrics
from mars.db import pg_text
from mars.domain.memory_policy import (
    MemoryControls,
    MemoryRecord,
    build_view,
    memory_controls,
    score_bounds,
    session_ranking,
)
from mars.domain.thread_state import (
    ThreadState,
    fold_turn,
    new_thread,
    render_active_state,
    thread_from_json,
    thread_to_json,
)
from mars.domain.vectors import decode_vector
from mars.retrieval.embedder import Embedder, LruEmbedder, embedder_tag, split_sessions
from mars.retrieval.hybrid import (
    POLICY_CONFIGS,
    HybridConfig,
    HybridMemory,
    chunk_pieces,
    state_conditioned,
)
from mars.retrieval.ranker import LearnedRanker, load_ranker
from mars.telemetry import step
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from mars_memory.settings import MemorySettings
from mars_memory.write_behind import WriteBehind

log = logging.getLogger(__name__)

RECORD_COLUMNS = (
    "record_id, session_id, turn_id, seq, user_text, assistant_text, thread_id, embedding, embedding_model, "
    "commit_no"
)


CATCH_UP_SQL = (
    f"SELECT {RECORD_COLUMNS} FROM memory_records "
    "WHERE tenant = %s AND user_id = %s AND commit_no > %s ORDER BY commit_no"
)
APPLIED_SQL = "SELECT applied_seq FROM memory_progress WHERE tenant = %s AND user_id = %s"
ACTIVE_THREAD_SQL = (
    "SELECT thread_id, title, state FROM memory_threads "
    "WHERE tenant = %s AND user_id = %s AND status = 'ACTIVE'"
)


def _blob(vectors: np.ndarray | None) -> bytes | None:
    return vectors.astype(np.float32).tobytes() if vectors is not None else None


def _record(row: tuple[object, ...]) -> MemoryRecord:
    return MemoryRecord(
        record_id=str(row[0]),
        session_id=str(row[1]),
        turn_id=str(row[2]),
        seq=int(row[3]),  # type: ignore[call-overload]
        user_text=str(row[4]),
        assistant_text=str(row[5]),
    )


def memory_ranker(settings: MemorySettings) -> LearnedRanker | None:
    """The learned ranker of the record and session rankings, as MARS_MEMORY_RANKER names it; None (the
    fused ranking) when it is off, the policy is not mars (the ranker learned the mars fusion's signals), or
    the model cannot be used."""
    choice = settings.memory_ranker.strip()
    if choice == "off" or settings.view_policy != "mars":
        return None
    ranker, why = load_ranker(None if choice == "packaged" else Path(choice))
    if ranker is None:
        log.warning("memory ranker unavailable, the fused ranking stays: %s", why)
    else:
        log.info("memory ranker %s", ranker.version)
    return ranker


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


class MemoryStore:
    """Postgres-backed memory of one deployment; every query is scoped to (tenant, user_id).

    Postgres holds the records, threads and chunk vectors; the FAISS + BM25 index of each user is a
    cache derived from them, loaded on the user's first view after a start and caught up by commit
    watermark before every use (a replica mostly sees the users of the partitions it owns, so indexes
    shard with the Kafka partitions, but correctness never depends on who wrote what).
    """

    def __init__(
        self, pool: AsyncConnectionPool, settings: MemorySettings, embedder: Embedder | None
    ) -> None:
        self._pool = pool
        self._settings = settings
        # None: the embedder could not load; views are served from Postgres-backed BM25 alone.
        self._embedder = embedder
        # Queries get a session of their own: a view never waits behind a stored turn's embedding.
        self._query_embedder: LruEmbedder | None = None
        if embedder is not None:
            self._embedder, queries = split_sessions(embedder)
            self._query_embedder = LruEmbedder(queries)
        self._model_name = embedder_tag(settings.embedding_model, settings.embedding_precision)
        self._applied = asyncio.Condition()
        #: The highest seq this process committed per user (committed in Postgres before it is set here).
        self._committed_seq: dict[tuple[str, str], int] = {}
        self._indexes: dict[tuple[str, str], UserIndex] = {}
        #: Query embeddings being computed, by text: a view awaits the one its prefetch started.
        self._embedding: dict[str, asyncio.Future[np.ndarray]] = {}
        base = POLICY_CONFIGS.get(settings.view_policy, POLICY_CONFIGS["mars"])
        self._config = dataclasses.replace(base, **settings.fusion)  # type: ignore[arg-type]
        self.ranker = memory_ranker(settings)
        #: Stored pairs embedded behind their commit (None: each in its commit, before it is applied).
        self.write_behind: WriteBehind | None = None
        if embedder is not None and settings.embed_behind > 0:
            self.write_behind = WriteBehind(self._embed_records, self._store_vectors, settings.embed_behind)
            metrics.watch_write_behind(self.write_behind)

    def _new_memory(self) -> HybridMemory:
        return HybridMemory(self._embedder, self._config, self._settings.use_gpu, self._query_embedder)

    async def user_index(self, tenant: str, user_id: str) -> UserIndex:
        """The user's cached index (empty the first time): call `catch_up` with `index.lock` held before
        using it."""
        key = (tenant, user_id)
        index = self._indexes.get(key)
        if index is None:
            sessions = self._new_memory() if self._settings.view_ranking_depth > 0 else None
            index = self._indexes.setdefault(key, UserIndex(self._new_memory(), sessions))
        return index

    async def forget(self, tenant: str, user_id: str) -> int:
        """Drop the user's index and every cached query vector (the user's rows are deleted from Postgres
        already: a later use rebuilds the index from what is left, nothing). Returns the records the index
        held. The whole query cache goes: which of its texts were this user's is not known where their
        index is not loaded here, and a turn asked with remember=false left a query and no record."""
        if self._query_embedder is not None:
            self._query_embedder.clear()
        self._committed_seq.pop((tenant, user_id), None)  # a forgotten user's seqs start again
        if self.write_behind is not None:
            self.write_behind.forget((tenant, user_id))
        index = self._indexes.pop((tenant, user_id), None)
        if index is None:
            return 0
        async with index.lock:  # a search in progress on it finishes first
            return len(index.records)

    async def catch_up(self, tenant: str, user_id: str, index: UserIndex) -> None:
        """Load the records committed after the index's watermark (call with index.lock held).

        Any replica may have applied the user's writes (the view and writer consumer groups are assigned
        independently, and a rebalance moves users between replicas), so the index follows the table, not
        this process's own commits. A view that waited for applied seq n-1 finds turn n-1 searchable,
        since the record and the applied mark are committed in one transaction."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(CATCH_UP_SQL, (tenant, user_id, index.record_no))
            rows = await cur.fetchall()
        await self._add_rows(index, rows)

    async def _add_rows(self, index: UserIndex, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        loaded = []
        for row in rows:
            record = _record(row)
            vectors = await self._vectors_of(record, blob=row[7], model=row[8])
            loaded.append((record, str(row[6]), vectors, int(row[9])))

        # Index writes on a worker thread too (FAISS adds), never beside a search: the lock is held.
        def add_all() -> None:
            for item in loaded:
                index.add(*item)

        await asyncio.to_thread(add_all)

    async def _vectors_of(self, record: MemoryRecord, blob: Any, model: Any) -> np.ndarray | None:
        """A loaded record's vectors: as stored, from the write-behind embedding under way, or (stored by
        another model, or by none) embedded here and stored back."""
        if self._embedder is None:
            return None
        if blob is not None and model == self._model_name:
            return np.frombuffer(bytes(blob), dtype=np.float32).reshape(-1, self._embedder.dim)
        pending = self.write_behind.pending(record.record_id) if self.write_behind else None
        if blob is None and pending is not None:
            with step("memory wait-write-behind"):
                try:
                    return await asyncio.shield(pending)
                except Exception:
                    pass  # it failed behind: embedded here
        vectors = (await asyncio.to_thread(self._embed_records, [record]))[0]
        await self._store_vectors([(record.record_id, vectors)])
        return vectors

    def _embed_records(self, records: Sequence[MemoryRecord]) -> list[np.ndarray]:
        """Each record's chunk vectors (as HybridMemory.add_group stores them), from one call of the model."""
        assert self._embedder is not None
        pieces = [chunk_pieces([r.text], self._config.max_chunk_words) for r in records]
        vectors = self._embedder.encode([p for ps in pieces for p in ps])
        bounds = np.cumsum([0] + [len(ps) for ps in pieces])
        return [vectors[a:b] for a, b in itertools.pairwise(bounds)]

    async def _store_vectors(self, vectors: list[tuple[str, np.ndarray]]) -> None:
        async with self._pool.connection() as conn, conn.cursor() as cur:
            await cur.executemany(
                "UPDATE memory_records SET embedding = %s, embedding_model = %s WHERE record_id = %s",
                [(_blob(v), self._model_name, rid) for rid, v in vectors],
            )

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

    async def applied_seq(self, conn: AsyncConnection, tenant: str, user_id: str) -> int:
        cur = await conn.execute(APPLIED_SQL, (tenant, user_id))
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    #: The bounded read-your-writes wait reads the applied seq again after this long, doubling up to LAST.
    FIRST_POLL_S = 0.05
    LAST_POLL_S = 0.4

    async def wait_applied(self, tenant: str, user_id: str, seq: int) -> bool:
        """True once seq is applied; False when the bounded wait ran out. This process's own commits wake
        the wait of their user only (no read); Postgres is read at first and after each poll interval, which
        grows, for commits by another replica. (Woken and reading at every commit of any user, a backlog of
        waiting views read the applied seq 13.7 times per turn at 25/s: CPU the backlog's commits needed.)"""
        key = (tenant, user_id)
        deadline = time.monotonic() + self._settings.read_your_writes_wait_s
        poll_s = self.FIRST_POLL_S
        while True:
            if self._committed_seq.get(key, 0) >= seq:
                return True
            async with self._pool.connection() as conn:
                if await self.applied_seq(conn, tenant, user_id) >= seq:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            async with self._applied:
                try:
                    await asyncio.wait_for(
                        self._applied.wait_for(lambda: self._committed_seq.get(key, 0) >= seq),
                        timeout=min(poll_s, remaining),
                    )
                    return True
                except TimeoutError:
                    pass
            poll_s = min(poll_s * 2, self.LAST_POLL_S)

    def _controls(self, state: ev.SessionState) -> MemoryControls:
        if self._settings.view_policy == "mars":
            return memory_controls(state)
        # The ablation policies ignore the state: a fixed budget of retrieved history, nothing else.
        return MemoryControls(False, 0, self._settings.ablation_top_k, ev.GLOBAL, False)

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
                return await self._view(index, text, state, active, session_id), True
        # Not applied yet: wait without holding the index, then read again.
        with step("memory wait-applied"):
            fresh = await self.wait_applied(tenant, user_id, after_seq)
        async with index.lock:
            with step("memory snapshot"):
                _, active = await self._snapshot(tenant, user_id, index)
            return await self._view(index, text, state, active, session_id), fresh

    async def _snapshot(
        self, tenant: str, user_id: str, index: UserIndex
    ) -> tuple[int, tuple[Any, ...] | None]:
        """Catch the index up and read the applied seq and the active thread, in one round trip (call with
        index.lock held)."""
        async with self._pool.connection() as conn, conn.pipeline() as pipeline:
            applied_cur = await conn.execute(APPLIED_SQL, (tenant, user_id))
            records_cur = await conn.execute(CATCH_UP_SQL, (tenant, user_id, index.record_no))
            active_cur = await conn.execute(ACTIVE_THREAD_SQL, (tenant, user_id))
            await pipeline.sync()
            applied_row = await applied_cur.fetchone()
            rows = await records_cur.fetchall()
            active = await active_cur.fetchone()
        await self._add_rows(index, rows)
        return (int(applied_row[0]) if applied_row else 0), active  # type: ignore[call-overload]

    async def _view(
        self,
        index: UserIndex,
        text: str,
        state: ev.SessionState,
        active: tuple[Any, ...] | None,
        session_id: str,
    ) -> ev.CandidateView:
        controls = self._controls(state)
        # A NEW_TOPIC turn starts a fresh thread: the old active thread becomes history.
        continuing = active is not None and state.action != ev.NEW_TOPIC
        thread_id = active[0] if continuing and active else None
        by_seq = sorted(index.records.values(), key=lambda r: r.seq)
        thread = [r for r in by_seq if index.thread_of[r.record_id] == thread_id]
        window = thread[-controls.recent_window :] if controls.recent_window > 0 else []
        active_state = None
        if continuing and active:
            thread_state = thread_from_json(active[2]) if active[2] else new_thread(str(active[1]))
            active_state = render_active_state(thread_state)
        ranked: list[tuple[MemoryRecord, float]] = []
        bounds = None
        if index.records and (controls.retrieve_k > 0 or index.sessions is not None):
            with step("memory embed-query"):  # cached: the searches below reuse it
                await self._query_vector(text)
        if controls.retrieve_k > 0 and index.records:
            with step("memory search"):
                ranked, bounds = await asyncio.to_thread(self._rank, index, text, thread, controls)
        shown = {r.record_id for r in window}
        # LOCAL scope keeps retrieval inside the active thread (Table 6: local evidence for revisions).
        in_scope = {r.record_id for r in thread} if controls.scope == ev.LOCAL else None
        view = build_view(
            controls,
            active_state,
            window,
            [
                (r, score)
                for r, score in ranked
                if r.record_id not in shown and (in_scope is None or r.record_id in in_scope)
            ],
            policy=self._settings.view_policy,
            ranking_bounds=bounds,
        )
        if index.sessions is not None and index.records:
            with step("memory rank-sessions"):
                sessions = await asyncio.to_thread(self._rank_sessions, index, text, session_id)
            view.ranking.extend(
                session_ranking(sessions, ranked, session_id, self._settings.view_ranking_depth)
            )
        return view

    def _rank_sessions(self, index: UserIndex, text: str, session_id: str) -> list[tuple[str, float]]:
        """The user's other sessions, best first, each ranked over its whole text (the RealMem unit of
        retrieval), with the policy's fusion and the session's recent user turns as context, the state
        aside (what it then lets into the view is the controller's part): the ranking `mars bench
        realmem` computes. The turn's own session is ranked as absent."""
        assert index.sessions is not None
        cfg, context = self._config, []
        if self._settings.view_policy == "mars":
            own = sorted(
                (r for r in index.records.values() if r.session_id == session_id), key=lambda r: r.seq
            )
            context = [r.user_text for r in own[-self._settings.memory_context_turns :]]
        depth = self._settings.view_ranking_depth
        return index.sessions.rank_groups(text, context, depth, cfg, {session_id}, self.ranker)

    def _fusion(self, thread: list[MemoryRecord], controls: MemoryControls) -> tuple[HybridConfig, list[str]]:
        """The fusion settings and secondary query texts of this turn's search."""
        cfg = self._config
        if self._settings.view_policy != "mars":
            return cfg, []
        context = [r.user_text for r in thread[-self._settings.memory_context_turns :]]
        return state_conditioned(cfg, controls.prefer_recent), context

    def _rank(
        self, index: UserIndex, text: str, thread: list[MemoryRecord], controls: MemoryControls
    ) -> tuple[list[tuple[MemoryRecord, float]], tuple[float, float] | None]:
        """Every record of the user, best first, as the view's policy ranks them for this turn (the view
        then keeps those its scope allows), and the score bounds of that ranking."""
        if self._settings.view_policy == "recent":
            newest = sorted(index.records.values(), key=lambda r: -r.seq)
            return [(r, 1.0) for r in newest], None
        cfg, context = self._fusion(thread, controls)
        ranked = index.memory.rank_groups(text, context, len(index.records), cfg, ranker=self.ranker)
        return [(index.records[rid], score) for rid, score in ranked], score_bounds(ranked)

    async def commit(self, event: ev.Generated) -> ev.MemoryCommitted:
        """Store the turn pair and advance the user's applied seq, in one transaction (idempotent by turn_id)
        of two round trips: the lock and the reads, then the writes and the commit (pipelined)."""
        turn = event.turn
        out = ev.MemoryCommitted(turn=turn, imported=event.imported)
        # Postgres refuses NUL in TEXT and JSONB: the turn is stored without it.
        query, answer = pg_text(event.query), pg_text(event.text)
        pair: tuple[MemoryRecord, np.ndarray | None] | None = None
        behind = False
        if event.status == ev.OK and turn.options.get("remember") != "false":
            record = MemoryRecord(uuid.uuid4().hex, turn.session_id, turn.turn_id, turn.seq, query, answer)
            # Embedded behind the commit (mars_memory.write_behind), or, with the write-behind at its bound,
            # before the transaction: no connection (nor the user's lock) is held meanwhile.
            behind = self.write_behind is not None and not self.write_behind.full
            vectors = None if behind else await asyncio.to_thread(self._embed_record, record)
            pair = record, vectors
        async with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
            # Serialise a user's commits (two replicas during a rebalance, or a redelivery).
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{turn.tenant}/{turn.user_id}",)
            )
            existing_cur = await conn.execute(
                "SELECT record_id, thread_id FROM memory_records WHERE turn_id = %s", (turn.turn_id,)
            )
            active_cur = await conn.execute(ACTIVE_THREAD_SQL, (turn.tenant, turn.user_id))
            existing = await existing_cur.fetchone()  # the first round trip
            active = await active_cur.fetchone()
            if existing is not None:
                out.record_id, out.thread_id, out.stored = existing[0], existing[1], True
                behind = False  # a redelivery: the pair was stored (and submitted) the first time
            elif pair is not None:
                await self._store_pair(conn, event, out, pair, active)
            # A failed (or remember=false) turn stores nothing but still advances seq, so turn n+1 never
            # waits for it.
            await conn.execute(
                """
                INSERT INTO memory_progress (tenant, user_id, applied_seq) VALUES (%s, %s, %s)
                ON CONFLICT (tenant, user_id) DO UPDATE
                SET applied_seq = GREATEST(memory_progress.applied_seq, EXCLUDED.applied_seq)
                """,
                (turn.tenant, turn.user_id, turn.seq),
            )
        # Indexes (this replica's and any other's) pick the record up from Postgres before their next use.
        key = (turn.tenant, turn.user_id)
        if behind and pair is not None and self.write_behind is not None:
            self.write_behind.submit(pair[0], key)
        if len(self._committed_seq) > 100_000:
            self._committed_seq.clear()  # a cache: a view not found here reads Postgres
        self._committed_seq[key] = max(self._committed_seq.get(key, 0), turn.seq)
        async with self._applied:
            self._applied.notify_all()
        return out

    async def _active_thread(
        self,
        conn: AsyncConnection,
        event: ev.Generated,
        out: ev.MemoryCommitted,
        active: tuple[Any, ...] | None,
        query: str,
    ) -> ThreadState:
        """The thread the turn goes to (a new one on NEW_TOPIC or when none is active), its id in `out`;
        `active` is the user's active thread row (ACTIVE_THREAD_SQL), read in the commit's transaction;
        `query` the turn's text as stored."""
        turn = event.turn
        thread_state = new_thread(query)
        if active is None or event.state.action == ev.NEW_TOPIC:
            if active is not None:
                await conn.execute(
                    "UPDATE memory_threads SET status = 'ARCHIVED' WHERE thread_id = %s", (active[0],)
                )
                out.archived_previous_thread = True
            out.thread_id = uuid.uuid4().hex
            await conn.execute(
                "INSERT INTO memory_threads (thread_id, tenant, user_id, status, opened_seq, title) "
                "VALUES (%s, %s, %s, 'ACTIVE', %s, %s)",
                (out.thread_id, turn.tenant, turn.user_id, turn.seq, query[:200]),
            )
        else:
            out.thread_id = active[0]
            thread_state = thread_from_json(active[2]) if active[2] else new_thread(str(active[1]))
        return thread_state

    async def _store_pair(
        self,
        conn: AsyncConnection,
        event: ev.Generated,
        out: ev.MemoryCommitted,
        pair: tuple[MemoryRecord, np.ndarray | None],
        active: tuple[Any, ...] | None,
    ) -> None:
        """The pair as a record of its thread, the thread's state folded with it (in the caller's
        transaction; writes only, so they go out pipelined with its commit)."""
        turn = event.turn
        record, vectors = pair
        thread_state = await self._active_thread(conn, event, out, active, record.user_text)
        thread_state = fold_turn(thread_state, turn.seq, record.user_text, record.assistant_text, event.state)
        await conn.execute(
            "UPDATE memory_threads SET state = %s WHERE thread_id = %s",
            (Jsonb(thread_to_json(thread_state)), out.thread_id),
        )
        out.record_id = record.record_id
        await conn.execute(
            "INSERT INTO memory_records (record_id, turn_id, tenant, user_id, session_id, thread_id, seq, "
            "user_text, assistant_text, embedding, embedding_model) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                record.record_id,
                turn.turn_id,
                turn.tenant,
                turn.user_id,
                turn.session_id,
                out.thread_id,
                turn.seq,
                record.user_text,
                record.assistant_text,
                _blob(vectors),
                self._model_name if vectors is not None else None,
            ),
        )
        out.stored = True

    async def _query_vector(self, text: str) -> None:
        """Put the query's vector in the query cache, or wait for the computation already under way."""
        if self._query_embedder is None:
            return
        pending = self._embedding.get(text)
        if pending is None:
            task: asyncio.Future[np.ndarray] = asyncio.ensure_future(
                asyncio.to_thread(self._query_embedder.encode, [text])
            )
            task.add_done_callback(lambda _: self._embedding.pop(text, None))
            self._embedding[text] = task
            pending = task
        await asyncio.shield(pending)

    def accept_query_embedding(self, text: str, tag: str, encoded: str) -> bool:
        """Hold the state controller's embedding of the turn's text as the query's vector, so each turn is
        embedded once. False where it cannot serve here (none given, another model, a bad vector): the
        view then embeds the text itself."""
        if not encoded or self._query_embedder is None:
            return False
        if tag != self._model_name:
            log.debug("turn embedding of %s, not %s: embedded again here", tag, self._model_name)
            return False
        try:
            vector = decode_vector(encoded)
        except ValueError as exc:
            log.warning("turn embedding not used (%s): embedded again here", exc)
            return False
        if vector.shape[0] != self._query_embedder.dim:
            dims = (vector.shape[0], self._query_embedder.dim)
            log.warning("turn embedding of %d dimensions, not %d: embedded again here", *dims)
            return False
        self._query_embedder.put(text, vector)
        return True

    def query_embedding(self, text: str) -> list[float]:
        """The query's vector (cached: a view that retrieved already embedded it), [] without an embedder."""
        if self._query_embedder is None or not self._settings.view_query_embedding:
            return []
        return [float(v) for v in self._query_embedder.encode([text])[0]]

    def _embed_record(self, record: MemoryRecord) -> np.ndarray | None:
        return self._embed_records([record])[0] if self._embedder is not None else None

    @property
    def dense_available(self) -> bool:
        return self._embedder is not None
