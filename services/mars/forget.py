"""Forget a user: every row of one (tenant, user_id) in every table, and every replica's caches of them.

Each service deletes the rows it owns, as it may touch no other's (mars.db_roles):
  - the ingress (Ingress.ForgetUser) deletes its own rows and the user's data key (`forget_own_async`), then
    publishes a UserForgotten event on mars.control carrying the user's turn ids (mars_ingress.forget_user);
  - every other service reads the event (its control reader, mars.runtime), deletes its own rows and its
    stages' ledger rows, and acknowledges in `ingress_forget_acks` (`acknowledge`), the one thing its
    role may write there;
  - the ingress waits for an acknowledgement from every owner (mars_ingress.forget_user.acknowledged) and
    names those missing.
The operators' `mars forget` (one login that may do everything) deletes every table at once
(`forget_user_sync`) and publishes the same event.

One place lists every table holding per-user rows (FORGET_TABLES) with the predicate that finds the user's
rows in it; `uncovered` tells which tables of a schema carry a per-user column and are not listed (a unit
test runs it over the services' migrations, the forget-user integration test over information_schema), so a
new table with a user column cannot be forgotten silently.

What a table is keyed by decides its predicate:
  - tenant + user_id: the row is the user's;
  - turn_id only (stage_emitted, router_decisions, router_ledger, router_shadow_decisions): the user's turn
    ids, gathered first from every table that has both (ingress_turns, memory_records, judge_feedback,
    judge_rewards); the ledger's feedback corrections ("<turn_id>#feedback-N") by the turn id before the '#';
  - policy_id (router_policies, router_arms): the user's own policy "user:tenant/user" and its variants
    ("user:tenant/user#query", a policy version's "user:tenant/user#v=v2"). Tenant or global policies keep
    what the user's rewards taught them: a model's matrices cannot be unlearned turn by turn (documented in
    the README).

Turns in flight while a user is forgotten: see `forget_user` (a race acknowledged, not prevented).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from mars import topology
from mars.v1 import events_pb2 as ev

#: Columns that make a row someone's: a table with any of them must be in FORGET_TABLES (or EXEMPT).
USER_COLUMNS = ("user_id", "turn_id", "session_key", "policy_id")


@dataclass(frozen=True)
class ForgetTable:
    table: str
    #: SQL predicate over the named parameters tenant, user_id, turns (the user's turn ids), policy
    #: (the user's own policy id) and session_prefix ("tenant/user_id/").
    where: str


_USER = "tenant = %(tenant)s AND user_id = %(user_id)s"
#: A turn's id, or an id derived from it ("<turn_id>#feedback-N": the ledger's feedback corrections).
_TURNS = "split_part(turn_id, '#', 1) = ANY(%(turns)s)"
_POLICY = "(policy_id = %(policy)s OR starts_with(policy_id, %(policy)s || '#'))"

#: Tables whose rows name the user's turns by turn_id and also carry tenant + user_id: the user's turn ids
#: are the union of theirs (read before anything is deleted).
TURN_SOURCES = ("ingress_turns", "memory_records", "judge_feedback", "judge_rewards")

#: Every table with per-user rows, in deletion order (children before parents: router_arms references
#: router_policies).
FORGET_TABLES: tuple[ForgetTable, ...] = (
    ForgetTable("stage_emitted", _TURNS),
    ForgetTable("router_decisions", f"({_TURNS} OR starts_with(session_key, %(session_prefix)s))"),
    ForgetTable("router_ledger", f"({_TURNS} OR {_POLICY})"),
    # A shadow policy's decisions on the user's turns, and those under the user's versioned policy ids.
    ForgetTable("router_shadow_decisions", f"({_TURNS} OR {_POLICY})"),
    ForgetTable("router_arms", _POLICY),
    ForgetTable("router_policies", _POLICY),
    ForgetTable("judge_feedback", _USER),
    ForgetTable("judge_rewards", _USER),
    ForgetTable("state_context", _USER),
    ForgetTable("memory_records", _USER),
    ForgetTable("memory_threads", _USER),
    ForgetTable("memory_progress", _USER),
    ForgetTable("ingress_turns", _USER),
    ForgetTable("ingress_user_seq", _USER),
    # The user's budgets, and those of the keys limited to them (before the keys: found through them).
    ForgetTable(
        "ingress_budgets",
        f"tenant = %(tenant)s AND (user_id = %(user_id)s OR key_id IN "
        f"(SELECT key_id FROM ingress_api_keys WHERE {_USER}))",
    ),
    # Keys limited to this user (tenant-wide keys have user_id NULL and stay).
    ForgetTable("ingress_api_keys", _USER),
    # The user's data key: without it their sealed text on every topic stays unreadable (mars.sealing).
    ForgetTable("user_data_keys", _USER),
)

#: The shared tables' per-user rows belong to one service each (the stage ledger to every stage, by `stage`).
SHARED_OWNERS = {"user_data_keys": "ingress"}
LEDGER = "stage_emitted"
#: Where the owners acknowledge a forget (the ingress's table, mars_ingress.schema).
FORGET_ACKS = "ingress_forget_acks"

#: Tables with a per-user column that hold nothing of a user (none today; name the reason when adding one).
EXEMPT: dict[str, str] = {}

#: The advisory lock the memory writer takes per user (mars_memory.postgres_store.PostgresStore.commit): a
#: commit in progress finishes before the user's rows are read, and none starts until they are deleted.
USER_LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext(%s))"


def owned_tables(service: str) -> tuple[str, ...]:
    """The tables the service's own migrations create (it owns them, mars.db_roles)."""
    statements = topology.service(service).migrations
    return tuple(dict.fromkeys(table for table, _ in migration_columns(statements)))


def owner(table: str) -> str | None:
    """The service whose rows of `table` it deletes (None: the ledger, shared by stage, or no service's)."""
    if table in SHARED_OWNERS:
        return SHARED_OWNERS[table]
    return next((name for name in topology.NAMES if table in owned_tables(name)), None)


def acknowledges(service: str) -> bool:
    """Whether the ingress waits for `service` to acknowledge a forget: every service but the ingress
    itself (each keeps at least its stage rows)."""
    return service != SHARED_OWNERS["user_data_keys"]


def acknowledgers() -> tuple[str, ...]:
    """The services the ingress waits for."""
    return tuple(name for name in topology.NAMES if acknowledges(name))


def user_policy_id(tenant: str, user_id: str) -> str:
    """The router's per-user policy id (mars_router.policy_tables.policy_id_for with scope "user")."""
    return f"user:{tenant}/{user_id}"


def params(tenant: str, user_id: str, turns: list[str]) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "user_id": user_id,
        "turns": turns,
        "policy": user_policy_id(tenant, user_id),
        "session_prefix": f"{tenant}/{user_id}/",
    }


def delete_statements() -> list[tuple[str, str]]:
    """(table, DELETE statement) in deletion order."""
    return [(t.table, f"DELETE FROM {t.table} WHERE {t.where}") for t in FORGET_TABLES]


def uncovered(columns: Iterable[tuple[str, str]]) -> list[str]:
    """Tables among (table, column) pairs that carry a per-user column and are neither forgotten nor
    exempt: each one is a table whose rows of a forgotten user would survive."""
    listed = {t.table for t in FORGET_TABLES} | set(EXEMPT)
    return sorted({table for table, column in columns if column in USER_COLUMNS and table not in listed})


_CREATE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)\s*\((.*)\)", re.S | re.I)
_ADD_COLUMN = re.compile(r"ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+)", re.I)


def migration_columns(statements: Iterable[str]) -> list[tuple[str, str]]:
    """(table, column) pairs of CREATE TABLE / ADD COLUMN migrations (for a check without a database)."""
    found: list[tuple[str, str]] = []
    for stmt in statements:
        if (create := _CREATE.search(stmt)) is not None:
            for part in re.split(r",(?![^()]*\))", create.group(2)):
                words = part.split()
                if words and words[0].upper() not in ("PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT"):
                    found.append((create.group(1), words[0].lower()))
        for table, column in _ADD_COLUMN.findall(stmt):
            found.append((table, column.lower()))
    return found


EXISTING_TABLES_SQL = "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"


def turn_ids_sql(present: set[str]) -> str | None:
    """The user's turn ids across the TURN_SOURCES tables that exist (None: none does)."""
    sources = [t for t in TURN_SOURCES if t in present]
    return " UNION ".join(f"SELECT turn_id FROM {t} WHERE {_USER}" for t in sources) or None


def forget_user_sync(conn: Any, tenant: str, user_id: str) -> dict[str, int]:
    """Delete the user's rows from every table (sync psycopg connection), in one transaction; rows deleted
    by table. Tables not created yet (a service never started against this database) count 0.

    Turns in flight: a turn of the user still in the pipeline when its rows are deleted may write a few
    rows afterwards (its memory record, its reward, its routing decision), since stages write by turn_id
    and are not told. The advisory lock keeps a memory commit from interleaving with the delete; anything
    written later is found by forgetting the user again (idempotent). Forget a user who is not talking."""
    with conn.transaction():
        conn.execute(USER_LOCK_SQL, (f"{tenant}/{user_id}",))
        present = {str(r[0]) for r in conn.execute(EXISTING_TABLES_SQL).fetchall()}
        turns: list[str] = []
        if (sql := turn_ids_sql(present)) is not None:
            turns = [str(r[0]) for r in conn.execute(sql, params(tenant, user_id, [])).fetchall()]
        values = params(tenant, user_id, turns)
        counts: dict[str, int] = {}
        for table, stmt in delete_statements():
            counts[table] = conn.execute(stmt, values).rowcount if table in present else 0
    return counts


async def forget_user_async(conn: Any, tenant: str, user_id: str) -> dict[str, int]:
    """`forget_user_sync` over an async psycopg connection."""
    async with conn.transaction():
        await conn.execute(USER_LOCK_SQL, (f"{tenant}/{user_id}",))
        cur = await conn.execute(EXISTING_TABLES_SQL)
        present = {str(r[0]) for r in await cur.fetchall()}
        turns: list[str] = []
        if (sql := turn_ids_sql(present)) is not None:
            cur = await conn.execute(sql, params(tenant, user_id, []))
            turns = [str(r[0]) for r in await cur.fetchall()]
        values = params(tenant, user_id, turns)
        counts: dict[str, int] = {}
        for table, stmt in delete_statements():
            if table in present:
                cur = await conn.execute(stmt, values)
                counts[table] = cur.rowcount
            else:
                counts[table] = 0
    return counts


async def forget_own_async(
    conn: Any,
    service: str,
    tenant: str,
    user_id: str,
    turn_ids: Iterable[str] = (),
    forget_id: str | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Delete, in one transaction, the user's rows that `service` owns: its tables among FORGET_TABLES (the
    data key for the ingress) and its stages' rows of the user's turns in the ledger. The turns are those
    given (the event's) and those its own tables name. With `forget_id`, the acknowledgement commits with
    the delete (so a replica that deleted nothing, having waited for the user's lock, acknowledges after
    the one that deleted). Rows deleted by table, and the turns; idempotent."""
    stages = list(topology.service(service).stages)
    mine = [t for t in FORGET_TABLES if t.table != LEDGER and owner(t.table) == service]
    async with conn.transaction():
        await conn.execute(USER_LOCK_SQL, (f"{tenant}/{user_id}",))
        cur = await conn.execute(EXISTING_TABLES_SQL)
        present = {str(r[0]) for r in await cur.fetchall()}
        turns = set(turn_ids)
        sources = [t for t in TURN_SOURCES if t in present and owner(t) == service]
        if sources:
            cur = await conn.execute(
                " UNION ".join(f"SELECT turn_id FROM {t} WHERE {_USER}" for t in sources),
                params(tenant, user_id, []),
            )
            turns |= {str(r[0]) for r in await cur.fetchall()}
        values = params(tenant, user_id, sorted(turns))
        counts: dict[str, int] = {}
        if LEDGER in present and stages:
            cur = await conn.execute(
                f"DELETE FROM {LEDGER} WHERE stage = ANY(%(stages)s) AND {_TURNS}",
                {**values, "stages": stages},
            )
            counts[LEDGER] = cur.rowcount
        for table in mine:
            if table.table in present:
                cur = await conn.execute(f"DELETE FROM {table.table} WHERE {table.where}", values)
                counts[table.table] = cur.rowcount
            else:
                counts[table.table] = 0
        if forget_id is not None:
            await acknowledge(conn, forget_id, service, counts)
    return counts, sorted(turns)


def owner_forgetter(
    service: str, pool: Any, then: Callable[[ev.UserForgotten], Awaitable[None]] | None = None
) -> Callable[[ev.UserForgotten], Awaitable[None]]:
    """A service's handler of UserForgotten: delete its own rows of the user, acknowledge, then `then` (the
    service's own: dropping what its replica caches). Every replica runs it; the second deletes 0 rows."""

    async def on_forgotten(event: ev.UserForgotten) -> None:
        async with pool.connection() as conn:
            await forget_own_async(
                conn, service, event.tenant, event.user_id, event.turn_ids, forget_id=event.forget_id
            )
        if then is not None:
            await then(event)

    return on_forgotten


async def acknowledge(conn: Any, forget_id: str, service: str, counts: dict[str, int]) -> None:
    """`service` has deleted its rows of the forget: every replica says so, and their counts add up."""
    await conn.execute(
        f"INSERT INTO {FORGET_ACKS} AS a (forget_id, service, rows_deleted) VALUES (%s, %s, %s) "
        "ON CONFLICT (forget_id, service) DO UPDATE SET rows_deleted = ("
        "SELECT jsonb_object_agg(k, coalesce((a.rows_deleted ->> k)::bigint, 0) "
        "+ coalesce((excluded.rows_deleted ->> k)::bigint, 0)) "
        "FROM jsonb_object_keys(a.rows_deleted || excluded.rows_deleted) AS k)",
        (forget_id, service, Jsonb(counts)),
    )
