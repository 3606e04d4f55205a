"""The budgets' store (mars_ingress.budgets holds the decision): the rows of `ingress_budgets`, read by the
ingress through a small cache (MARS_INGRESS_QUOTA_BUDGET_CACHE_S) and written by `mars tenant set-budget`;
and the use they are checked against, summed per user and per key from the ingress's own `ingress_turns`
(each turn's `key_id`, `tokens` and judged `cost_usd`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mars.auth import ID_PATTERN
from mars.ttl_cache import TtlCache

from mars_ingress.budgets import ANY, WINDOW_S, BudgetRow, Scope, Use, scope_name

if TYPE_CHECKING:  # the CLI (mars_tools.tenant_cli) imports this module with psycopg alone
    from psycopg_pool import AsyncConnectionPool

_COLUMNS = "tenant, user_id, key_id, each_user, usd_per_day, tokens_per_minute"
#: The rows that may apply to a turn of (tenant, user, key): the user's, the key's and the each-user default.
APPLICABLE_SQL = (
    f"SELECT {_COLUMNS} FROM ingress_budgets WHERE tenant = %(tenant)s AND (each_user "
    "OR (user_id = %(user)s AND key_id = '*') OR (user_id = '*' AND key_id = %(key)s))"
)
_DAY_START = "(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')"
_IN_WINDOW = f"created_at > now() - make_interval(secs => {WINDOW_S:g}) AND tokens IS NOT NULL"
#: One user's or key's use (the column is user_id or key_id): the judged cost of its turns today, its
#: turns' tokens in the sliding minute (times and counts, oldest first), and the database's clock.
_USE_SQL = (
    "SELECT %(scope)s::text, coalesce(sum(cost_usd) FILTER (WHERE created_at >= {day}), 0)::float8, "
    "coalesce(array_agg(extract(epoch FROM created_at)::float8 ORDER BY created_at) FILTER (WHERE {win}), "
    "'{{}}'), coalesce(array_agg(tokens::float8 ORDER BY created_at) FILTER (WHERE {win}), '{{}}'), "
    "extract(epoch FROM now())::float8 FROM ingress_turns WHERE tenant = %(tenant)s AND {col} = %(id)s "
    "AND created_at >= least({day}, now() - make_interval(secs => {window:g}))"
)


def use_sql(column: str) -> str:
    return _USE_SQL.format(day=_DAY_START, win=_IN_WINDOW, col=column, window=WINDOW_S)


USER_USE_SQL = use_sql("user_id")
KEY_USE_SQL = use_sql("key_id")


def row_from(values: Iterable[Any]) -> BudgetRow:
    tenant, user_id, key_id, each_user, usd, tokens = values
    return BudgetRow(
        str(tenant),
        str(user_id),
        str(key_id),
        bool(each_user),
        None if usd is None else float(usd),
        None if tokens is None else int(tokens),
    )


def use_from(row: Iterable[Any]) -> tuple[Scope, Use, float]:
    scope, usd, times, tokens, now = row
    return scope, Use(float(usd), tuple(zip(map(float, times), map(float, tokens), strict=True))), float(now)


#: Rows cached per (tenant, user, key) at most; beyond it the cache starts over.
CACHE_ENTRIES = 10_000


#: Whether a tenant has any budget: a tenant without one costs a read per cache time, not one per user.
HAS_BUDGETS_SQL = "SELECT EXISTS (SELECT 1 FROM ingress_budgets WHERE tenant = %s)"


class BudgetStore:
    """The ingress's reads: each (tenant, user, key)'s budget rows, cached for `ttl_s` (and whether the
    tenant has any), and the use of the user and key those rows need."""

    def __init__(
        self, pool: AsyncConnectionPool, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._pool = pool
        self._clock = clock
        self._cache: TtlCache[tuple[str, str, str], list[BudgetRow]] = TtlCache(ttl_s, CACHE_ENTRIES)
        self._tenants: TtlCache[str, bool] = TtlCache(ttl_s, CACHE_ENTRIES)

    async def _has_budgets(self, tenant: str, now: float) -> bool:
        hit = self._tenants.get(tenant, now)
        if hit is not None:
            return hit
        async with self._pool.connection() as conn:
            cur = await conn.execute(HAS_BUDGETS_SQL, (tenant,))
            row = await cur.fetchone()
        found = bool(row and row[0])
        self._tenants.put(tenant, found, now)
        return found

    async def rows(self, tenant: str, user_id: str, key_id: str | None) -> list[BudgetRow]:
        now = self._clock()
        if not await self._has_budgets(tenant, now):
            return []
        entry = (tenant, user_id, key_id or ANY)
        hit = self._cache.get(entry, now)
        if hit is not None:
            return hit
        async with self._pool.connection() as conn:
            cur = await conn.execute(APPLICABLE_SQL, {"tenant": tenant, "user": user_id, "key": key_id or ""})
            rows = [row_from(r) for r in await cur.fetchall()]
        self._cache.put(entry, rows, now)
        return rows

    def forget_user(self, tenant: str, user_id: str) -> None:
        """A forgotten user's rows are gone: not served from the cache either."""
        self._cache.drop(lambda k: k[:2] == (tenant, user_id))

    async def uses(
        self, tenant: str, user_id: str | None, key_id: str | None
    ) -> tuple[dict[Scope, Use], float]:
        """The use of the user and the key (each only when given), and the database's clock (epoch s)."""
        queries = [(USER_USE_SQL, "user", user_id), (KEY_USE_SQL, "key", key_id)]
        asked = [
            (sql, {"scope": scope, "tenant": tenant, "id": ident}) for sql, scope, ident in queries if ident
        ]
        found: dict[Scope, Use] = {}
        now = time.time()
        if not asked:
            return found, now
        async with self._pool.connection() as conn:
            for sql, values in asked:
                cur = await conn.execute(sql, values)
                row = await cur.fetchone()
                assert row is not None  # an aggregate always has its row
                scope, use, now = use_from(row)
                found[scope] = use
        return found, now


# --- `mars tenant set-budget | clear-budget | budgets` (a sync psycopg connection) -------------------------


@dataclass(frozen=True)
class Target:
    """Whose budget a command acts on: one user, one key, or each user of the tenant."""

    tenant: str
    user_id: str = ANY
    key_id: str = ANY

    @property
    def each_user(self) -> bool:
        return self.user_id == ANY and self.key_id == ANY

    @property
    def scope(self) -> str:
        return scope_name(self.user_id, self.key_id)


def check_target(conn: Any, target: Target) -> None:
    """ValueError for ids no turn could carry, and for a key that is not one of the tenant's."""
    for what, value in (("tenant", target.tenant), ("user", target.user_id), ("key", target.key_id)):
        if value != ANY or what == "tenant":
            if not ID_PATTERN.match(value):
                raise ValueError(f"{what} must match {ID_PATTERN.pattern}, got {value!r}")
    if target.key_id != ANY:
        found = conn.execute(
            "SELECT tenant FROM ingress_api_keys WHERE key_id = %s", (target.key_id,)
        ).fetchone()
        if found is None or found[0] != target.tenant:
            raise ValueError(f"no API key {target.key_id} of tenant {target.tenant} (see `mars tenant list`)")


def set_budget(
    conn: Any, target: Target, usd_per_day: float | None, tokens_per_minute: int | None
) -> BudgetRow:
    """Set the given limits of the target's budget (creating it), keeping a limit not given; the row now."""
    BudgetRow(target.tenant, target.user_id, target.key_id, target.each_user, usd_per_day, tokens_per_minute)
    check_target(conn, target)
    row = conn.execute(
        f"INSERT INTO ingress_budgets AS b ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (tenant, user_id, key_id) DO UPDATE SET "
        "usd_per_day = coalesce(excluded.usd_per_day, b.usd_per_day), "
        "tokens_per_minute = coalesce(excluded.tokens_per_minute, b.tokens_per_minute), updated_at = now() "
        f"RETURNING {_COLUMNS}",
        (target.tenant, target.user_id, target.key_id, target.each_user, usd_per_day, tokens_per_minute),
    ).fetchone()
    return row_from(row)


def clear_budget(conn: Any, target: Target, kinds: tuple[str, ...]) -> bool:
    """Clear the given limits of the target's budget (`kinds`: usd_per_day, tokens_per_minute; empty: the
    whole budget); a budget left with no limit is deleted. False: the target had no budget."""
    where = "tenant = %s AND user_id = %s AND key_id = %s"
    ids = (target.tenant, target.user_id, target.key_id)
    with conn.transaction():
        if kinds:
            sets = ", ".join(f"{k} = NULL" for k in kinds)
            kept = " OR ".join(
                f"{k} IS NOT NULL" for k in ("usd_per_day", "tokens_per_minute") if k not in kinds
            )
            if kept:
                cur = conn.execute(
                    f"UPDATE ingress_budgets SET {sets}, updated_at = now() WHERE {where} AND ({kept})", ids
                )
                if cur.rowcount:
                    return True
        return bool(conn.execute(f"DELETE FROM ingress_budgets WHERE {where}", ids).rowcount)


@dataclass(frozen=True)
class Listed:
    """A budget with its use now (None: the each-user default, whose use is each user's own)."""

    row: BudgetRow
    use: Use | None
    now: float


def list_budgets(conn: Any, tenant: str | None) -> list[Listed]:
    """Every budget (of `tenant`, or all), with the current use of its user or key."""
    rows = [
        row_from(r)
        for r in conn.execute(
            f"SELECT {_COLUMNS} FROM ingress_budgets WHERE %(tenant)s::text IS NULL OR tenant = %(tenant)s "
            "ORDER BY tenant, each_user DESC, user_id, key_id",
            {"tenant": tenant},
        ).fetchall()
    ]
    out: list[Listed] = []
    for row in rows:
        now = time.time()
        use: Use | None = None
        if not row.each_user:
            sql, ident = (USER_USE_SQL, row.user_id) if row.user_id != ANY else (KEY_USE_SQL, row.key_id)
            found = conn.execute(sql, {"scope": "user", "tenant": row.tenant, "id": ident}).fetchone()
            _, use, now = use_from(found)
        out.append(Listed(row, use, now))
    return out


def move_key_budget(conn: Any, old_key_id: str, new_key_id: str) -> int:
    """A rotated key's budget goes to the key that replaces it (its use starts over with the new key)."""
    cur = conn.execute("UPDATE ingress_budgets SET key_id = %s WHERE key_id = %s", (new_key_id, old_key_id))
    return int(cur.rowcount)
