"""Postgres access shared by the services: a connection pool and migrations (with the shared tables: the
emitted-event ledger, mars.emitted, and the users' data keys)."""

from __future__ import annotations

import logging
import select
import zlib
from collections.abc import Sequence

import psycopg
from psycopg import AsyncConnection, pq
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.base import AttemptWithBackoff

from mars.data_keys import DATA_KEYS_MASTER_ID, DATA_KEYS_SCHEMA
from mars.emitted import EMITTED_SCHEMA

log = logging.getLogger(__name__)

#: What every service creates besides its own tables: the emitted-event ledger and the users' data keys.
SHARED_SCHEMAS = (EMITTED_SCHEMA, DATA_KEYS_SCHEMA, DATA_KEYS_MASTER_ID)


# Reconnect soon after Postgres comes back: the library's 1 s first wait doubling each time turned a 1 s
# restart into a 10 s stall of every service (measured by the chaos harness); 0.2 s growing 1.5x is found
# again within a few hundred ms and still backs off from a database that stays down.
AttemptWithBackoff.INITIAL_DELAY = 0.2
AttemptWithBackoff.DELAY_BACKOFF = 1.5


def pg_text(value: str) -> str:
    """Text as Postgres stores it: without NUL characters, which TEXT and JSONB refuse (an event's text may
    hold them; everything else about it is fine)."""
    return value.replace("\x00", "") if "\x00" in value else value


async def check_idle_connection(conn: AsyncConnection) -> None:
    """The pool's check when a connection is taken, without a round trip: an idle connection's socket has
    nothing to read unless the server closed it (a Postgres restart) or sent an error, so a readable socket
    means a broken connection. Closed here, the pool drops it and hands out a fresh one. (psycopg's own
    check_connection sends an empty query: one round trip per checkout, ~20 per turn.)"""
    if conn.closed or conn.pgconn.status != pq.ConnStatus.OK:
        raise psycopg.OperationalError("connection is closed")
    readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    if readable:
        await conn.close()
        raise psycopg.OperationalError("the server closed the idle connection")


async def open_pool(dsn: str, max_size: int = 8, wait_s: float = 30.0) -> AsyncConnectionPool:
    # check: a connection broken by a Postgres restart is replaced when taken, not handed to a handler.
    pool = AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        open=False,
        kwargs={"autocommit": True},
        check=check_idle_connection,
        # A handler waits at most this for a connection, then fails as transient and its batch is retried.
        timeout=10.0,
    )
    await pool.open(wait=True, timeout=wait_s)
    return pool


MIGRATION_LOCK = zlib.crc32(b"mars-migrations")
#: Whether the login may apply the shared schemas: the ledger does not exist yet, or it is the ledger's
#: owner. A service logging in as its own role (mars.db_roles) is neither: `mars migrate` applied them.
_OWNS_SHARED_SQL = (
    "SELECT coalesce((SELECT tableowner = current_user FROM pg_tables "
    "WHERE schemaname = current_schema() AND tablename = 'stage_emitted'), true)"
)


async def migrate(pool: AsyncConnectionPool, owner: str, statements: Sequence[str]) -> None:
    """Apply idempotent DDL under an advisory lock, so services starting together do not race."""
    async with pool.connection() as conn:
        await migrate_on(conn, statements)


async def migrate_on(conn: AsyncConnection, statements: Sequence[str]) -> None:
    """`migrate` on one connection, as whatever role it is now (`mars migrate` sets each service's)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        cur = await conn.execute(_OWNS_SHARED_SQL)
        row = await cur.fetchone()
        shared = SHARED_SCHEMAS if row is not None and row[0] else ()
        for stmt in (*shared, *statements):
            await conn.execute(stmt)  # type: ignore[arg-type]
