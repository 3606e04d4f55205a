"""Every service's schema in one place, for `mars migrate` (a Helm hook Job before the services start).

The statements are the services' own (each spec's migrations, its schema module's `MIGRATIONS`, gathered by
`mars.topology`: imported, never copied), applied the way each service applies them at start: `mars.db.migrate`, under the
same advisory lock, so a migrate Job and services starting beside it do not race. Everything is idempotent
(IF NOT EXISTS), so a rerun is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from psycopg import AsyncConnection, sql

from mars import db, db_roles, topology


def service_migrations(service: str) -> Sequence[str]:
    """The DDL `service` applies at start (besides the shared ledger, which `db.migrate` adds)."""
    return topology.service(service).migrations


#: What the schema holds: ("table", name), ("index", name), ("column", "table.column").
SchemaObject = tuple[str, str]


async def schema_objects(conn: AsyncConnection) -> set[SchemaObject]:
    """Tables, indexes and columns in the connection's current schema (to say what a migration added)."""
    rels = await conn.execute(
        "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'i')"
    )
    found: set[SchemaObject] = {
        ("index" if kind == "i" else "table", name) for name, kind in await rels.fetchall()
    }
    cols = await conn.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = current_schema()"
    )
    found |= {("column", f"{table}.{column}") for table, column in await cols.fetchall()}
    return found


@dataclass(frozen=True)
class Migrated:
    service: str
    statements: int
    #: Tables, indexes and columns that were not there before, sorted.
    added: tuple[SchemaObject, ...]


def new_objects(before: set[SchemaObject], after: set[SchemaObject]) -> tuple[SchemaObject, ...]:
    """What `after` has that `before` did not; a new table's columns are left out (the table says it)."""
    added = after - before
    new_tables = {name for kind, name in added if kind == "table"}
    return tuple(
        sorted(
            (kind, name)
            for kind, name in added
            if not (kind == "column" and name.split(".", 1)[0] in new_tables)
        )
    )


@dataclass(frozen=True)
class RoleSetup:
    """A role per service (mars.db_roles): the roles' prefix and the passwords to set (service ->
    password; a role missing here keeps the one it has)."""

    prefix: str = db_roles.DEFAULT_PREFIX
    passwords: Mapping[str, str] = field(default_factory=dict)


async def _run(conn: AsyncConnection, statements: Sequence[sql.Composed]) -> None:
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (db.MIGRATION_LOCK,))
        for stmt in statements:
            await conn.execute(stmt)


async def _tables(conn: AsyncConnection) -> set[str]:
    return {name for kind, name in await schema_objects(conn) if kind == "table"}


async def migrate_all(
    dsn: str, services: Sequence[str] | None = None, wait_s: float = 30.0, roles: RoleSetup | None = None
) -> list[Migrated]:
    """Apply each service's schema (one transaction per service, under the migrations lock); what each
    added. Needs a live Postgres at `dsn` (waits up to `wait_s` for it to accept a connection). With
    `roles`, the login must be allowed to create roles: each service's schema is applied as its own role,
    which then owns it, and the shared tables' grants follow (mars.db_roles)."""
    services = topology.NAMES if services is None else services
    unknown = [s for s in services if s not in topology.NAMES]
    if unknown:
        raise ValueError(f"unknown service(s) {', '.join(unknown)} (expected {', '.join(topology.NAMES)})")
    pool = await db.open_pool(dsn, max_size=2, wait_s=wait_s)
    done: list[Migrated] = []
    try:
        async with pool.connection() as conn:
            if roles is not None:
                await _run(conn, db_roles.role_statements(roles.prefix, roles.passwords))
                await db.migrate_on(conn, ())  # the shared tables, the admin's
                await _run(conn, db_roles.ownership_statements(roles.prefix, await _tables(conn)))
            for service in services:
                statements = service_migrations(service)
                before = await schema_objects(conn)
                if roles is not None:
                    await conn.execute(
                        sql.SQL("SET ROLE {}").format(sql.Identifier(db_roles.role_name(service, roles.prefix)))
                    )
                try:
                    await db.migrate_on(conn, statements)
                finally:
                    if roles is not None:
                        await conn.execute("RESET ROLE")
                after = await schema_objects(conn)
                done.append(Migrated(service, len(statements) + 1, new_objects(before, after)))
            if roles is not None:
                await _run(conn, db_roles.grant_statements(roles.prefix, await _tables(conn)))
    finally:
        await pool.close()
    return done
