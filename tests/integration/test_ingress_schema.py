"""The ingress's schema upgrade on real Postgres: the column ImportHistory's wait counts (memory_stored_at)
marks the pairs imported before it existed once, when it is added, and never a pair imported after."""

from __future__ import annotations

import psycopg
import pytest
from mars_ingress.schema import MIGRATIONS

pytestmark = pytest.mark.integration

ADDS_STORED_AT = next(i for i, stmt in enumerate(MIGRATIONS) if "memory_stored_at" in stmt)


def _imported(conn: psycopg.Connection, turn_id: str) -> None:
    conn.execute(
        "INSERT INTO ingress_turns (turn_id, tenant, user_id, session_id, seq, status, finished_at) "
        "VALUES (%s, 't', 'u', 's', 1, 'IMPORTED', now())",
        (turn_id,),
    )


def test_pairs_imported_before_the_upgrade_count_as_stored_and_later_ones_wait_for_memory(
    postgres: str,
) -> None:
    with psycopg.connect(postgres, autocommit=True) as conn:
        for stmt in MIGRATIONS[:ADDS_STORED_AT]:  # the schema of the release before
            conn.execute(stmt)
        _imported(conn, "before")
        for stmt in MIGRATIONS:  # the upgrade, then a restart that applies it all again
            conn.execute(stmt)
        _imported(conn, "after")
        for stmt in MIGRATIONS:
            conn.execute(stmt)
        rows = conn.execute(
            "SELECT turn_id, memory_stored_at IS NOT NULL FROM ingress_turns ORDER BY turn_id"
        ).fetchall()
    assert rows == [("after", False), ("before", True)]
