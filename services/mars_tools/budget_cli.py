"""`mars tenant set-budget | clear-budget | budgets`: budgets per end user and per API key, beside the
tenant's quotas (mars_ingress.budgets): USD per UTC day and tokens per sliding minute, in the ingress's
table ingress_budgets (MARS_POSTGRES_DSN or --postgres-dsn). Ingress replicas apply a change within
MARS_INGRESS_QUOTA_BUDGET_CACHE_S (5 s)."""

from __future__ import annotations

import argparse
from typing import Any

from mars import auth
from mars_ingress import budget_store
from mars_ingress.budget_store import Listed, Target
from mars_ingress.budgets import ANY, BudgetRow
from mars_ingress.schema import MIGRATIONS
from rich.markup import escape
from rich.table import Table

from mars_tools.admin_cli import SettingsError, add_postgres_dsn_arg, load_settings
from mars_tools.terminal import console

#: What the ingress's schema must have for the budget commands (the table, and the turns' key and tokens).
_NEEDED_SQL = (
    "SELECT to_regclass('ingress_budgets') IS NOT NULL AND EXISTS (SELECT 1 FROM information_schema.columns "
    "WHERE table_schema = current_schema() AND table_name = 'ingress_turns' AND column_name = 'tokens')"
)


def ensure_schema(conn: Any) -> None:
    """A database the ingress has not migrated yet gets the ingress's schema, as `mars migrate` would (under
    its advisory lock); one that has it is left alone."""
    if conn.execute(_NEEDED_SQL).fetchone()[0]:
        return
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (auth.MIGRATION_LOCK,))
        for stmt in MIGRATIONS:
            conn.execute(stmt)


def _run(args: argparse.Namespace, action: Any) -> int:
    import psycopg

    try:
        dsn = load_settings(postgres_dsn=args.postgres_dsn).postgres_dsn
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            ensure_schema(conn)
            return int(action(conn))
    except (SettingsError, ValueError) as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    except Exception as exc:  # Postgres away or refusing: one line, not a traceback
        console.print(f"[red]cannot reach Postgres: {type(exc).__name__}: {escape(str(exc))}[/]")
        return 1


def _target(args: argparse.Namespace) -> Target:
    return Target(args.tenant, args.user or ANY, args.key or ANY)


def limits_text(row: BudgetRow) -> str:
    parts = []
    if row.usd_per_day is not None:
        parts.append(f"${row.usd_per_day:g}/day")
    if row.tokens_per_minute is not None:
        parts.append(f"{row.tokens_per_minute} tokens/min")
    return ", ".join(parts)


def cmd_set(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        row = budget_store.set_budget(conn, _target(args), args.usd_per_day, args.tokens_per_minute)
        console.print(
            f"budget of {escape(row.scope)} of tenant {escape(row.tenant)}: {limits_text(row)}; ingress "
            "replicas apply it within MARS_INGRESS_QUOTA_BUDGET_CACHE_S"
        )
        return 0

    if args.usd_per_day is None and args.tokens_per_minute is None:
        console.print("[red]give --usd-per-day, --tokens-per-minute or both[/]")
        return 2
    return _run(args, action)


def cmd_clear(args: argparse.Namespace) -> int:
    kinds = tuple(k for k in ("usd_per_day", "tokens_per_minute") if getattr(args, k))

    def action(conn: Any) -> int:
        target = _target(args)
        if not budget_store.clear_budget(conn, target, kinds):
            console.print(f"[red]no budget of {escape(target.scope)} of tenant {escape(target.tenant)}[/]")
            return 1
        console.print("cleared " + (", ".join(kinds) if kinds else "the budget"))
        return 0

    return _run(args, action)


def _use_cells(item: Listed) -> tuple[str, str]:
    """Each limit with its use now ("-" for the each-user default: each user's use is their own)."""
    row, use = item.row, item.use
    usd = tokens = ""
    if row.usd_per_day is not None:
        usd = f"${use.usd_today:.4f} of ${row.usd_per_day:g}" if use else f"${row.usd_per_day:g} each"
    if row.tokens_per_minute is not None:
        used = f"{use.tokens_in_window(item.now):g} of " if use else ""
        tokens = f"{used}{row.tokens_per_minute}" + ("" if use else " each")
    return usd, tokens


def cmd_list(args: argparse.Namespace) -> int:
    def action(conn: Any) -> int:
        table = Table(title="Budgets (use: USD today, tokens in the last minute)", title_justify="left")
        for col in ("tenant", "for", "USD per day", "tokens per minute"):
            table.add_column(col)
        for item in budget_store.list_budgets(conn, args.tenant):
            table.add_row(item.row.tenant, item.row.scope, *_use_cells(item))
        console.print(table)
        return 0

    return _run(args, action)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    add_postgres_dsn_arg(p)
    p.add_argument("--tenant", required=True, help="the tenant whose user or key it is")
    whose = p.add_mutually_exclusive_group(required=True)
    whose.add_argument("--user", help="one end user of the tenant")
    whose.add_argument("--key", help="one API key of the tenant, by its id (`mars tenant list`)")
    whose.add_argument(
        "--each-user",
        action="store_true",
        help="the default for each user of the tenant (a user's own limit of the same kind replaces it)",
    )


def _non_negative(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def add_budget_parsers(tenant_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = tenant_sub.add_parser(
        "set-budget",
        help="set a budget (USD per day, tokens per minute) of one user, one key, or each user",
        description="A turn is refused (RESOURCE_EXHAUSTED; 429 at the gateway) while its user's or its key's "
        "budget is spent: USD per UTC day (the judged cost of its turns since 00:00 UTC) or tokens per "
        "sliding minute (each turn's text when admitted, then the answering call's prompt + answer tokens). "
        "The turn that crosses a limit is let in; the next waits until the budget frees up. Setting one "
        "limit keeps the other; 0 refuses every turn. The tenant's own quotas (MARS_INGRESS_QUOTA_*) apply too.",
    )
    _add_target_args(p)
    p.add_argument("--usd-per-day", type=_non_negative(float), help="USD per UTC day")
    p.add_argument("--tokens-per-minute", type=_non_negative(int), help="tokens per sliding minute")
    p.set_defaults(func=cmd_set)

    p = tenant_sub.add_parser(
        "clear-budget",
        help="remove a budget, or one of its limits",
        description="Without --usd-per-day or --tokens-per-minute the whole budget goes; with one, only that "
        "limit (a budget left with none goes). Exit 1 when there was no such budget.",
    )
    _add_target_args(p)
    p.add_argument("--usd-per-day", action="store_true", help="clear only the USD-per-day limit")
    p.add_argument("--tokens-per-minute", action="store_true", help="clear only the tokens-per-minute limit")
    p.set_defaults(func=cmd_clear)

    p = tenant_sub.add_parser("budgets", help="list the budgets with their use now")
    add_postgres_dsn_arg(p)
    p.add_argument("--tenant", help="only this tenant's budgets")
    p.set_defaults(func=cmd_list)
