"""load.py's Postgres round trips per turn: each statement goes to the service owning the table it names."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "load-tests"))
import pg_statements


def test_statements_go_to_their_tables_owner() -> None:
    owners = pg_statements.table_owners()
    assert owners["state_context"] == "state" and owners["memory_records"] == "memory"
    assert owners["ingress_turns"] == "ingress" and owners["router_ledger"] == "router"
    cases = {
        "INSERT INTO stage_emitted (stage, turn_id) VALUES ($1, $2) ON CONFLICT DO NOTHING": "stage ledger (every stage)",
        "SELECT recent_texts, thread_depth, session_id FROM state_context WHERE tenant = $1": "state",
        "UPDATE memory_threads SET state = $1 WHERE thread_id = $2": "memory",
        "WITH t AS (UPDATE ingress_turns SET status = $1 RETURNING seq) SELECT * FROM t": "ingress",
        "BEGIN": "transaction begin/commit",
        "commit": "transaction begin/commit",
        "SELECT pg_advisory_xact_lock(hashtext($1))": "other",
    }
    for query, owner in cases.items():
        assert pg_statements.owner_of(query, owners) == owner, query
