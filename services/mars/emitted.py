"""The stage ledger (`stage_emitted`): which stage emitted its event for which turn, so a redelivered
input is answered once (mars.bus.output.StageOutput). Written behind, in one statement per flush."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

EMITTED_SCHEMA = """
CREATE TABLE IF NOT EXISTS stage_emitted (
    stage TEXT NOT NULL,
    turn_id TEXT NOT NULL,
    emitted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (stage, turn_id)
)
"""


async def already_emitted(conn: AsyncConnection, stage: str, turn_id: str) -> bool:
    cur = await conn.execute(
        "SELECT 1 FROM stage_emitted WHERE stage = %s AND turn_id = %s", (stage, turn_id)
    )
    return await cur.fetchone() is not None


async def mark_emitted_many(conn: AsyncConnection, rows: Sequence[tuple[str, str]]) -> None:
    """(stage, turn_id) rows into the ledger in one statement."""
    await conn.execute(
        "INSERT INTO stage_emitted (stage, turn_id) SELECT * FROM unnest(%s::text[], %s::text[]) "
        "ON CONFLICT DO NOTHING",
        ([stage for stage, _ in rows], [turn_id for _, turn_id in rows]),
    )


class EmittedLedger:
    """Write-behind of one process's `stage_emitted` rows: one INSERT per flush instead of one round trip
    per emitted event (5.6 statements per turn before). A flush runs before a consumer commits offsets
    (`StageConsumer`, every 0.5 s), so a record's offset is never committed before its row is written, and
    FLUSH_EVERY_S after the first unwritten row, for rows no commit follows soon. A process that dies
    with rows unwritten has left those records uncommitted too: they are delivered again and answered
    again, the at-least-once copy the next stage drops as it drops any other (its stage output remembers
    what it answered; see `mars.bus.output.StageOutput`)."""

    FLUSH_EVERY_S = 0.5

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self._pool = pool
        self._pending: list[tuple[str, str]] = []
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, stage: str, turn_id: str) -> None:
        self._pending.append((stage, turn_id))
        if self._timer is None or self._timer.done():
            self._timer = asyncio.get_running_loop().create_task(self._flush_later())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.FLUSH_EVERY_S)
        try:
            await self.flush()
        except Exception as exc:  # kept: the next flush (a commit's, or the next row's timer) writes them
            log.warning("stage ledger: %d rows not written yet: %r", len(self._pending), exc)

    async def flush(self) -> None:
        """Write every row added so far; raises (and keeps them) when Postgres refuses."""
        async with self._lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            try:
                async with self._pool.connection() as conn:
                    await mark_emitted_many(conn, batch)
            except BaseException:
                self._pending[:0] = batch
                raise
