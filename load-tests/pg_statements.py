"""Postgres round trips per turn, by the service that owns each statement's table (`load.py`): the stack's
Postgres runs pg_stat_statements; each MARS rate resets it, and afterwards every statement's calls are
divided by the turns sent. A statement belongs to the owner of the first table it names (mars.topology's
schemas; `stage_emitted` is the stages' shared ledger); BEGIN and COMMIT are the transactions' own round
trips."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

#: Postgres settings that load the extension (a server setting: needs the server's start).
SERVER_SETTINGS = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all"}
_TABLE = re.compile(r"\b(?:FROM|INTO|UPDATE|JOIN)\s+([a-z_]+)", re.I)
_CORE_TABLES = {
    "stage_emitted": "stage ledger (every stage)",
    "user_data_keys": "data keys (every stage)",
    "ingress_api_keys": "ingress",
}


def table_owners() -> dict[str, str]:
    """Table -> the service whose schema creates it (mars.topology)."""
    from mars import topology

    owners = dict(_CORE_TABLES)
    for spec in topology.SERVICES:
        for stmt in spec.migrations:
            m = re.search(r"CREATE TABLE IF NOT EXISTS (\w+)", stmt)
            if m:
                owners[m.group(1)] = spec.name
    return owners


def owner_of(query: str, owners: dict[str, str]) -> str:
    head = query.strip().split(None, 1)[0].upper() if query.strip() else ""
    if head in ("BEGIN", "COMMIT", "ROLLBACK"):
        return "transaction begin/commit"
    for table in _TABLE.findall(query):
        if table.lower() in owners:
            return owners[table.lower()]
    return "other"


def enable(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")


def reset(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


def per_turn(dsn: str, turns: int) -> dict[str, Any]:
    """Statements per turn by owner, and the busiest statements, since the last reset (this harness's own
    queries left out)."""
    import psycopg

    owners = table_owners()
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls FROM pg_stat_statements WHERE dbid = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) AND query NOT LIKE '%pg_stat_statements%'"
        ).fetchall()
    by_owner: Counter[str] = Counter()
    for query, calls in rows:
        by_owner[owner_of(str(query), owners)] += int(calls)
    top = sorted(rows, key=lambda r: -int(r[1]))[:40]
    n = max(1, turns)
    return {
        "total": sum(by_owner.values()) / n,
        "by_owner": {o: c / n for o, c in by_owner.most_common()},
        "top": [(" ".join(str(q).split())[:160], int(c) / n) for q, c in top],
    }


def print_report(report: dict[str, Any], rate: float) -> None:
    print(f"\n[load] Postgres statements per turn at {rate:g}/s: {report['total']:.1f}")
    for owner, per in report["by_owner"].items():
        print(f"  {owner:30s} {per:5.2f}")
    for query, per in report["top"]:
        print(f"    {per:5.2f}  {query}")
