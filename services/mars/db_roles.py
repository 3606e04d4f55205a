"""A Postgres role per service: least privilege in the database.

Each service logs in as its own role, `<prefix>_<service>` (`role_name`):
  - it owns the tables its schema creates (`owned_tables`, read from its migrations), and is granted
    nothing of another service's;
  - the shared tables belong to the login that runs `mars migrate` (the admin), and each role gets only
    its part of them:
      - `stage_emitted`: the rows of its own stages (row-level security on `stage`, from the topology's
        `stages`);
      - `user_data_keys`: the ingress makes and deletes keys; the other services read them;
      - `ingress_forget_acks` (the ingress's): every other service may add its own acknowledgement of a
        forget, and nothing else (row-level security on `service`).

`<prefix>_operator` is the tools' login: a member of every service role, so it may do what any service may
(mint keys, forget users, read rows for replay) and no more: it creates no role and owns no table.

`mars migrate --roles` applies it all (`mars.migrations.migrate_all`): roles, then each service's schema
applied as its role, so that the role owns what it creates, then the grants. Everything is idempotent, so a
rerun (each `helm upgrade`) also takes over the tables of a deployment that ran with one login before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from psycopg import sql
from psycopg.conninfo import make_conninfo

from mars import topology
from mars.forget import FORGET_ACKS, SHARED_OWNERS, owned_tables, owner

#: Roles are `<prefix>_<service>`; a prefix per deployment keeps two releases on one server apart.
DEFAULT_PREFIX = "mars"
OPERATOR = "operator"
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}\Z")

#: The shared tables (mars.db.SHARED_SCHEMAS): the admin owns them, the roles get their part.
SHARED_TABLES = ("stage_emitted", "user_data_keys")
#: Who makes (and, on a forget, deletes) the users' data keys; every other service only reads them.
DATA_KEY_WRITER = SHARED_OWNERS["user_data_keys"]


def check_prefix(prefix: str) -> str:
    if not _NAME.match(prefix):
        raise ValueError(
            f"role prefix {prefix!r} must be lower-case letters, digits and '_', starting with a letter"
        )
    return prefix


def role_name(service: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The Postgres role `service` logs in as (`operator` for the tools)."""
    if service != OPERATOR:
        topology.service(service)  # ValueError for a name the deployment does not have
    return f"{check_prefix(prefix)}_{service}"


def roles(prefix: str = DEFAULT_PREFIX) -> dict[str, str]:
    """Every login, service (and operator) -> role."""
    return {name: role_name(name, prefix) for name in (*topology.NAMES, OPERATOR)}


def role_statements(prefix: str, passwords: Mapping[str, str]) -> list[sql.Composed]:
    """Create each login role that is missing (LOGIN, nothing else), set the passwords given (service ->
    password; a role without one keeps its own), and let each service create tables in the schema (its
    own, at start, as a new version adds one)."""
    out: list[sql.Composed] = []
    for service, role in roles(prefix).items():
        # CREATE ROLE has no IF NOT EXISTS; a DO block checks first, and a literal is safe in it.
        out.append(
            sql.SQL(
                "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {name}) THEN "
                "CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS; END IF; END $$"
            ).format(name=sql.Literal(role), role=sql.Identifier(role))
        )
        out.append(
            sql.SQL("ALTER ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS").format(
                sql.Identifier(role)
            )
        )
        if passwords.get(service):
            out.append(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(passwords[service])
                )
            )
        if service == OPERATOR:
            for member_of in topology.NAMES:
                out.append(
                    sql.SQL("GRANT {} TO {}").format(
                        sql.Identifier(role_name(member_of, prefix)), sql.Identifier(role)
                    )
                )
        else:
            out.append(
                sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(
                    sql.Identifier("public"), sql.Identifier(role)
                )
            )
    return out


def ownership_statements(prefix: str, present: set[str]) -> list[sql.Composed]:
    """Each existing service table given to its service's role (a table made under one login before)."""
    out: list[sql.Composed] = []
    for service in topology.NAMES:
        for table in owned_tables(service):
            if table in present:
                out.append(
                    sql.SQL("ALTER TABLE {} OWNER TO {}").format(
                        sql.Identifier(table), sql.Identifier(role_name(service, prefix))
                    )
                )
    return out


def _policy(name: str, table: str, role: str, using: sql.Composable) -> list[sql.Composed]:
    return [
        sql.SQL("DROP POLICY IF EXISTS {} ON {}").format(sql.Identifier(name), sql.Identifier(table)),
        sql.SQL("CREATE POLICY {} ON {} TO {} USING ({using}) WITH CHECK ({using})").format(
            sql.Identifier(name), sql.Identifier(table), sql.Identifier(role), using=using
        ),
    ]


def grant_statements(prefix: str, present: set[str]) -> list[sql.Composed]:
    """The shared tables' grants and row policies (after every service's schema exists)."""
    out: list[sql.Composed] = []
    for table in SHARED_TABLES:
        out.append(sql.SQL("REVOKE ALL ON {} FROM PUBLIC").format(sql.Identifier(table)))
    out.append(sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(sql.Identifier("stage_emitted")))
    for spec in topology.SERVICES:
        role = role_name(spec.name, prefix)
        out.append(
            sql.SQL("GRANT SELECT, INSERT, DELETE ON {} TO {}").format(
                sql.Identifier("stage_emitted"), sql.Identifier(role)
            )
        )
        stages = sql.SQL(", ").join(sql.Literal(s) for s in spec.stages) if spec.stages else sql.SQL("NULL")
        out += _policy(
            f"{role}_stages", "stage_emitted", role, sql.SQL("stage IN ({})").format(stages)
        )
        keys = "SELECT, INSERT, DELETE" if spec.name == DATA_KEY_WRITER else "SELECT"
        out.append(
            sql.SQL(f"GRANT {keys} ON {{}} TO {{}}").format(
                sql.Identifier("user_data_keys"), sql.Identifier(role)
            )
        )
    if FORGET_ACKS in present:
        out.append(sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(sql.Identifier(FORGET_ACKS)))
        for spec in topology.SERVICES:
            if spec.name == owner(FORGET_ACKS):
                continue
            role = role_name(spec.name, prefix)
            # UPDATE and SELECT: the replicas' acknowledgements add up (mars.forget.acknowledge); the row
            # policy keeps each service to its own rows.
            out.append(
                sql.SQL("GRANT SELECT, INSERT, UPDATE ON {} TO {}").format(
                    sql.Identifier(FORGET_ACKS), sql.Identifier(role)
                )
            )
            out += _policy(
                f"{role}_acks",
                FORGET_ACKS,
                role,
                sql.SQL("service = {}").format(sql.Literal(spec.name)),
            )
    return out


def login_dsn(dsn: str, role: str, password: str) -> str:
    """`dsn` (a URL or key=value string) logging in as `role` with `password` instead."""
    return make_conninfo(dsn, user=role, password=password)
