"""The memory service's durable state in Postgres: turn pairs with their chunk vectors (memory_records),
threads (memory_threads) and each user's applied seq (memory_progress). Every query is scoped to
(tenant, user_id); the indexes (mars_memory.user_index) are derived from what is here."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from mars.domain.memory_policy import MemoryRecord
from mars.domain.thread_state import ThreadState, fold_turn, new_thread, thread_from_json, thread_to_json
from mars.v1 import events_pb2 as ev
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

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

#: The user's active thread as ACTIVE_THREAD_SQL reads it: (thread_id, title, state).
ThreadRow = tuple[Any, ...]
#: A turn pair to store, with its chunk vectors (None: embedded behind the commit, or no embedder).
Pair = tuple[MemoryRecord, np.ndarray | None]


@dataclass(frozen=True)
class StoredPair:
    """A turn pair as a record of memory_records, read back for an index."""

    record: MemoryRecord
    thread_id: str
    #: Its chunk vectors as float32 bytes, and the embedder tag they were computed with (None: none yet).
    embedding: bytes | None
    embedding_model: str | None
    #: Its place in the table's commit order (an index's watermark).
    commit_no: int


def _blob(vectors: np.ndarray | None) -> bytes | None:
    return vectors.astype(np.float32).tobytes() if vectors is not None else None


def _stored_pair(row: tuple[Any, ...]) -> StoredPair:
    """A row of RECORD_COLUMNS."""
    record = MemoryRecord(
        record_id=str(row[0]),
        session_id=str(row[1]),
        turn_id=str(row[2]),
        seq=int(row[3]),
        user_text=str(row[4]),
        assistant_text=str(row[5]),
    )
    blob, model = row[7], row[8]
    return StoredPair(
        record=record,
        thread_id=str(row[6]),
        embedding=bytes(blob) if blob is not None else None,
        embedding_model=str(model) if model is not None else None,
        commit_no=int(row[9]),
    )


class PostgresStore:
    """The memory's SQL: reads for the indexes and views, and each turn's commit in one transaction.
    `model_name` tags the vectors written (embedder_tag), so another model's are recognised on load."""

    def __init__(self, pool: AsyncConnectionPool, model_name: str) -> None:
        self._pool = pool
        self._model_name = model_name

    async def applied_seq(self, tenant: str, user_id: str) -> int:
        async with self._pool.connection() as conn:
            cur = await conn.execute(APPLIED_SQL, (tenant, user_id))
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def records_after(self, tenant: str, user_id: str, commit_no: int) -> list[StoredPair]:
        """The user's records committed after `commit_no`, in commit order."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(CATCH_UP_SQL, (tenant, user_id, commit_no))
            rows = await cur.fetchall()
        return [_stored_pair(row) for row in rows]

    async def snapshot(
        self, tenant: str, user_id: str, commit_no: int
    ) -> tuple[int, list[StoredPair], ThreadRow | None]:
        """The applied seq, the records committed after `commit_no` and the active thread, in one round
        trip (pipelined)."""
        async with self._pool.connection() as conn, conn.pipeline() as pipeline:
            applied_cur = await conn.execute(APPLIED_SQL, (tenant, user_id))
            records_cur = await conn.execute(CATCH_UP_SQL, (tenant, user_id, commit_no))
            active_cur = await conn.execute(ACTIVE_THREAD_SQL, (tenant, user_id))
            await pipeline.sync()
            applied_row = await applied_cur.fetchone()
            rows = await records_cur.fetchall()
            active = await active_cur.fetchone()
        applied = int(applied_row[0]) if applied_row else 0
        return applied, [_stored_pair(row) for row in rows], active

    async def store_vectors(self, vectors: list[tuple[str, np.ndarray]]) -> None:
        """(record_id, chunk vectors) pairs written to their records (an embedding done after the commit)."""
        async with self._pool.connection() as conn, conn.cursor() as cur:
            await cur.executemany(
                "UPDATE memory_records SET embedding = %s, embedding_model = %s WHERE record_id = %s",
                [(_blob(v), self._model_name, rid) for rid, v in vectors],
            )

    async def commit(self, event: ev.Generated, pair: Pair | None) -> tuple[ev.MemoryCommitted, bool]:
        """Store the turn's pair (None: nothing to store) and advance the user's applied seq, in one
        transaction (idempotent by turn_id) of two round trips: the lock and the reads, then the writes
        and the commit (pipelined). Returns the commit and whether the turn was stored already (a
        redelivery: `pair` was not written)."""
        turn = event.turn
        out = ev.MemoryCommitted(turn=turn, imported=event.imported)
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
        return out, existing is not None

    async def _active_thread(
        self,
        conn: AsyncConnection,
        event: ev.Generated,
        out: ev.MemoryCommitted,
        active: ThreadRow | None,
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
        pair: Pair,
        active: ThreadRow | None,
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
