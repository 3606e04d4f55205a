"""`mars tenant create|list|rotate|revoke`: the API keys callers present at the ingress (mars.auth); and
`set-budget|clear-budget|budgets`, the budgets per user and per key (mars_tools.budget_cli).

Keys live hashed (SHA-256) in the pipeline's Postgres (MARS_POSTGRES_DSN or --postgres-dsn), table
ingress_api_keys; the key itself is printed once, at creation or rotation, and cannot be shown again.
"""

from __future__ import annotations

import argparse
from typing import Any

from mars import auth
from mars_ingress import budget_store
from rich.markup import escape
from rich.table import Table

from mars_tools.admin_cli import SettingsError, add_postgres_dsn_arg, load_settings
from mars_tools.budget_cli import add_budget_parsers
from mars_tools.terminal import console


def _connect(args: argparse.Namespace) -> Any:
    import psycopg

    dsn = load_settings(postgres_dsn=args.postgres_dsn).postgres_dsn
    conn = psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    auth.ensure_schema(conn)  # a fresh database: the table is created as `mars migrate` would
    return conn


def _run(args: argparse.Namespace, action: Any) -> int:
    try:
        with _connect(args) as conn:
            return int(action(conn))
    except SettingsError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]cannot reach Postgres: {type(exc).__name__}: {escape(str(exc))}[/]")
        return 1


def _show_new(new: auth.NewKey, what: str) -> None:
    scope = f"user {new.user_id}" if new.user_id else "any user"
    admin = ", admin" if new.admin else ""
    # The key alone on stdout's last line, so scripts can take it with `tail -1`.
    console.print(f"{what} key {new.key_id} for tenant {new.tenant} ({scope}{admin}); it is shown only once:")
    print(new.key, flush=True)


def cmd_create(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        _show_new(auth.issue(conn, args.tenant, args.user, args.admin, args.label or ""), "created")
        return 0

    return _run(args, action)


def cmd_list(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        keys = auth.list_keys(conn, args.tenant, args.all)
        table = Table(title="API keys", title_justify="left")
        for col in ("key id", "tenant", "user", "admin", "label", "created", "revoked"):
            table.add_column(col)
        for k in keys:
            revoked = ""
            if k.revoked_at is not None:
                revoked = f"{k.revoked_at:%Y-%m-%d %H:%M}" + (f" -> {k.replaced_by}" if k.replaced_by else "")
            table.add_row(
                k.key_id,
                k.tenant,
                k.user_id or "(any)",
                "yes" if k.admin else "",
                k.label,
                f"{k.created_at:%Y-%m-%d %H:%M}",
                revoked,
            )
        console.print(table)
        return 0

    return _run(args, action)


def cmd_rotate(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        new = auth.rotate(conn, args.key_id)
        if new is None:
            console.print(f"[red]no live key {escape(args.key_id)}[/] (see `mars tenant list --all`)")
            return 1
        _show_new(new, f"replaced {args.key_id} (revoked) by")
        if conn.execute("SELECT to_regclass('ingress_budgets') IS NOT NULL").fetchone()[0]:
            if budget_store.move_key_budget(conn, args.key_id, new.key_id):
                console.print(f"its budget now applies to {new.key_id} (its use starts over)")
        return 0

    return _run(args, action)


def cmd_revoke(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        if not auth.revoke(conn, args.key_id):
            console.print(f"[red]no live key {escape(args.key_id)}[/] (see `mars tenant list --all`)")
            return 1
        console.print(
            f"revoked {args.key_id}; ingress replicas stop accepting it within MARS_INGRESS_AUTH_CACHE_TTL_S"
        )
        return 0

    return _run(args, action)


def add_tenant_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tenant = sub.add_parser(
        "tenant",
        help="create, list, rotate and revoke the tenants' API keys; set budgets per user and per key",
        description="Callers of the ingress send `authorization: Bearer <key>` gRPC metadata; the key names "
        "the tenant (and optionally the one user) it acts for. Keys are stored as SHA-256 hashes in the "
        "Postgres at --postgres-dsn / MARS_POSTGRES_DSN; a key is printed once, when created or rotated. "
        "A revoked key stops working within MARS_INGRESS_AUTH_CACHE_TTL_S (5 s) on every ingress replica. "
        "Budgets per user and per key (USD per day, tokens per minute): set-budget, clear-budget, budgets. "
        "Exit 0 on success, 1 when Postgres failed or the key does not exist, 2 for bad input.",
    )
    tenant_sub = tenant.add_subparsers(dest="tenant_cmd", required=True)

    common = add_postgres_dsn_arg

    p = tenant_sub.add_parser(
        "create",
        help="issue a new key for TENANT and print it (once)",
        description="Issues a random key (mars_ + 32 random bytes) for TENANT. Without --user it acts for "
        "any user of the tenant; with --user only for that user. --admin marks it for tenant administration "
        "(e.g. forgetting a user). The key is printed alone on the last line of stdout.",
    )
    common(p)
    p.add_argument("tenant", help="the tenant the key acts for")
    p.add_argument("--user", help="limit the key to this end user (default: any user of the tenant)")
    p.add_argument("--admin", action="store_true", help="an admin key (tenant administration calls)")
    p.add_argument("--label", help="a note shown by `mars tenant list` (e.g. who holds the key)")
    p.set_defaults(func=cmd_create)

    p = tenant_sub.add_parser("list", help="list keys (ids, tenants, scope; never the keys themselves)")
    common(p)
    p.add_argument("--tenant", help="only this tenant's keys")
    p.add_argument("--all", action="store_true", help="include revoked keys")
    p.set_defaults(func=cmd_list)

    p = tenant_sub.add_parser(
        "rotate",
        help="issue a new key like KEY_ID (same tenant, user, admin flag, budget) and revoke KEY_ID",
    )
    common(p)
    p.add_argument(
        "key_id",
        help="the id of the key to replace (`mars tenant list`; an id starting with '-' goes after --)",
    )
    p.set_defaults(func=cmd_rotate)

    p = tenant_sub.add_parser("revoke", help="revoke KEY_ID")
    common(p)
    p.add_argument(
        "key_id",
        help="the id of the key to revoke (`mars tenant list`; an id starting with '-' goes after --)",
    )
    p.set_defaults(func=cmd_revoke)

    add_budget_parsers(tenant_sub)
