"""The stage ledger's write-behind (`mars.emitted.EmittedLedger`) against a real Postgres: rows reach the table
in one statement per flush, by timer or before offsets are committed, and a refused flush keeps its rows."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from mars import db, emitted

pytestmark = pytest.mark.integration


async def _rows(pool: db.AsyncConnectionPool, stage: str) -> set[str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT turn_id FROM stage_emitted WHERE stage = %s", (stage,))
        return {str(r[0]) for r in await cur.fetchall()}


def test_rows_are_written_in_one_statement_per_flush(postgres: str) -> None:
    async def scenario() -> None:
        pool = await db.open_pool(postgres)
        await db.migrate(pool, "ledger-test", ())
        try:
            ledger = emitted.EmittedLedger(pool)
            for n in range(5):
                ledger.add("ledger-a", f"turn-{n}")
            ledger.add("ledger-b", "turn-0")
            assert ledger.pending == 6
            assert await _rows(pool, "ledger-a") == set()  # nothing written yet: the rows wait
            await ledger.flush()  # what a consumer does before it commits offsets
            assert ledger.pending == 0
            assert await _rows(pool, "ledger-a") == {f"turn-{n}" for n in range(5)}
            assert await _rows(pool, "ledger-b") == {"turn-0"}
            # The timer writes what is added later without anyone asking; a duplicate is no error.
            ledger.add("ledger-a", "turn-0")
            ledger.add("ledger-a", "turn-9")
            await asyncio.sleep(emitted.EmittedLedger.FLUSH_EVERY_S + 1.0)
            assert ledger.pending == 0
            assert "turn-9" in await _rows(pool, "ledger-a")
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_refused_flush_keeps_its_rows_for_the_next(postgres: str) -> None:
    async def scenario() -> None:
        pool = await db.open_pool(postgres)
        await db.migrate(pool, "ledger-test", ())
        try:
            ledger = emitted.EmittedLedger(pool)
            ledger.add("ledger-c", "ok-1")
            ledger.add("ledger-c", "bad\x00id")  # Postgres refuses NUL in TEXT: the whole batch fails
            with pytest.raises(psycopg.DataError):
                await ledger.flush()
            assert ledger.pending == 2  # kept, in order: nothing was lost
            assert await _rows(pool, "ledger-c") == set()
        finally:
            await pool.close()

    asyncio.run(scenario())
