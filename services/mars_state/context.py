"""The state service's table: each user's active context (recent user turns of the active thread, the
thread's depth, the last seq it reflects and that turn's session). Only this service writes it: the state
stage after each turn, and ImportContext for what a history import leaves active."""

from __future__ import annotations

from dataclasses import dataclass

from mars.db import pg_text
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

#: Advanced only by a newer seq, so a redelivered older turn or an import made again cannot roll it back.
_UPSERT = """
    INSERT INTO state_context (tenant, user_id, recent_texts, thread_depth, last_seq, session_id)
    VALUES (%s, %s, %s, %s, %s, %s)
    ON CONFLICT (tenant, user_id) DO UPDATE
    SET recent_texts = EXCLUDED.recent_texts, thread_depth = EXCLUDED.thread_depth,
        last_seq = EXCLUDED.last_seq, session_id = EXCLUDED.session_id
    WHERE state_context.last_seq < EXCLUDED.last_seq
"""


@dataclass(frozen=True)
class ActiveContext:
    recent: list[str]
    thread_depth: int
    #: The session of the last turn it reflects (None: a row from before the column).
    session_id: str | None


class ContextStore:
    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool

    async def load(self, tenant: str, user_id: str) -> ActiveContext | None:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT recent_texts, thread_depth, session_id FROM state_context "
                "WHERE tenant = %s AND user_id = %s",
                (tenant, user_id),
            )
            row = await cur.fetchone()
        if row is None:
            return None
        return ActiveContext(list(row[0]), int(row[1]), None if row[2] is None else str(row[2]))

    async def save(
        self, tenant: str, user_id: str, recent: list[str], depth: int, seq: int, session_id: str
    ) -> bool:
        """Keep the context as of `seq` unless the user's is at or past it already; whether it was kept.
        Postgres refuses NUL in text (and in JSONB strings): the context keeps the texts without it."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                _UPSERT, (tenant, user_id, Jsonb([pg_text(t) for t in recent]), depth, seq, session_id)
            )
            return cur.rowcount > 0
