"""Budgets per user and per key (mars_ingress.budgets): which rows apply to a turn, which budget binds, when
it frees up (00:00 UTC for USD per day, the sliding minute for tokens), debt, and what the caller is told
(the gateway's x-ratelimit-* headers, mars_gateway.mapping)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from mars import metrics
from mars.v1 import services_pb2 as svc
from mars_gateway import mapping
from mars_ingress import budget_store, budgets
from mars_ingress.admission import budget_failure, rate_limits
from mars_ingress.budgets import Budget, BudgetRow, Use

T = "acme"
#: 2026-12-06 17:30:00 UTC.
NOW = datetime(2026, 12, 6, 17, 30, tzinfo=UTC).timestamp()


def rows() -> list[BudgetRow]:
    return [
        BudgetRow(T, each_user=True, usd_per_day=1.0, tokens_per_minute=2000),
        BudgetRow(T, user_id="alice", tokens_per_minute=5000),
        BudgetRow(T, key_id="k1", usd_per_day=10.0),
    ]


def test_a_row_names_a_user_or_a_key_or_is_the_default_for_each_user() -> None:
    with pytest.raises(ValueError, match="not both"):
        BudgetRow(T, user_id="alice", key_id="k1", usd_per_day=1)
    with pytest.raises(ValueError, match="default for each user"):
        BudgetRow(T, usd_per_day=1)  # (tenant, '*', '*') is only the each-user default
    with pytest.raises(ValueError, match="default for each user"):
        BudgetRow(T, user_id="alice", each_user=True, usd_per_day=1)
    with pytest.raises(ValueError, match="--usd-per-day"):
        BudgetRow(T, user_id="alice")
    with pytest.raises(ValueError, match=">= 0"):
        BudgetRow(T, user_id="alice", tokens_per_minute=-1)
    assert BudgetRow(T, each_user=True, usd_per_day=1).scope == "each user"
    assert BudgetRow(T, key_id="k1", usd_per_day=1).scope == "key k1"


def test_the_users_own_limit_replaces_the_default_limit_by_limit() -> None:
    alice = budgets.applicable(rows(), "alice", "k1")
    assert alice == [
        Budget("user", "usd_per_day", 1.0, default=True),  # alice's row sets no USD: the default's
        Budget("user", "tokens_per_minute", 5000.0),  # her own
        Budget("key", "usd_per_day", 10.0),
    ]
    bob = budgets.applicable(rows(), "bob", "k2")  # another key: no key budget
    assert bob == [
        Budget("user", "usd_per_day", 1.0, default=True),
        Budget("user", "tokens_per_minute", 2000.0, default=True),
    ]
    assert budgets.applicable(rows()[1:], "bob", None) == []  # no default, no key (auth off)
    assert {b.label for b in alice + bob} <= set(metrics.BUDGET_KINDS)


def test_room_while_the_use_is_below_the_limit_and_the_crossing_turn_is_debt() -> None:
    limit = [Budget("user", "tokens_per_minute", 2000.0)]
    under = Use(recent_tokens=((NOW - 10, 1999.0),))
    assert budgets.decide(limit, {"user": under}, NOW).binding is None
    # One turn of 5000 tokens went in below the limit: the next waits until it leaves the window.
    over = Use(recent_tokens=((NOW - 10, 1500.0), (NOW - 5, 5000.0)))
    verdict = budgets.decide(limit, {"user": over}, NOW)
    assert verdict.binding is not None and verdict.binding.used == 6500
    assert verdict.binding.reset_at == NOW - 5 + 60  # 5000 alone is over the limit: both must leave
    # Tokens older than the minute do not count.
    old = Use(recent_tokens=((NOW - 61, 9999.0),))
    assert budgets.decide(limit, {"user": old}, NOW).binding is None


def test_tokens_free_up_as_the_oldest_turns_leave_the_sliding_minute() -> None:
    recent = [(NOW - 50, 1000.0), (NOW - 30, 800.0), (NOW - 10, 500.0)]  # 2300 in the window
    assert budgets.tokens_free_at(recent, 2000, NOW) == NOW - 50 + 60  # 1300 left after the oldest
    assert budgets.tokens_free_at(recent, 1000, NOW) == NOW - 30 + 60  # 500 left after two
    assert budgets.tokens_free_at(recent, 400, NOW) == NOW - 10 + 60  # all three must go
    assert budgets.tokens_free_at(recent, 5000, NOW) == NOW  # room now


def test_usd_per_day_frees_at_the_next_midnight_utc() -> None:
    limit = [Budget("key", "usd_per_day", 0.5)]
    verdict = budgets.decide(limit, {"key": Use(usd_today=0.5)}, NOW)
    assert verdict.binding is not None
    assert verdict.binding.reset_at == datetime(2026, 12, 7, tzinfo=UTC).timestamp()
    assert budgets.day_end(datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC).timestamp()) == (
        datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    )
    assert budgets.decide(limit, {"key": Use(usd_today=0.49)}, NOW).binding is None


def test_the_exhausted_budget_that_frees_up_last_binds() -> None:
    both = [Budget("user", "tokens_per_minute", 100.0), Budget("key", "usd_per_day", 1.0)]
    uses = {"user": Use(recent_tokens=((NOW - 30, 150.0),)), "key": Use(usd_today=2.0)}
    binding = budgets.decide(both, uses, NOW).binding
    assert binding is not None and binding.budget.scope == "key"  # midnight is after the minute
    uses["key"] = Use(usd_today=0.1)
    binding = budgets.decide(both, uses, NOW).binding
    assert binding is not None and binding.budget.kind == "tokens_per_minute"
    # The user's budget does not read the key's use, nor the other way round.
    assert budgets.decide(both, {"key": Use(recent_tokens=((NOW, 1e9),))}, NOW).binding is None


def test_the_refusal_names_the_budget_its_limit_and_when_it_frees() -> None:
    default = Budget("user", "tokens_per_minute", 2000.0, default=True)
    verdict = budgets.decide([default], {"user": Use(recent_tokens=((NOW - 20, 2500.0),))}, NOW)
    failure = budget_failure(verdict, NOW)
    assert failure.code.name == "RESOURCE_EXHAUSTED"
    assert str(failure) == (
        "user budget (the tenant's default for each user) of 2000 tokens/min reached (2500 tokens used); "
        "frees at 2026-12-06T17:30:40Z"
    )
    trailing = dict(failure.trailing)
    assert trailing["retry-after-ms"] == "40000" and trailing["grpc-retry-pushback-ms"] == "-1"
    assert trailing["mars-budget"] == "user_tokens_per_minute"
    assert trailing["mars-ratelimit-limit-tokens"] == "2000"
    assert trailing["mars-ratelimit-remaining-tokens"] == "0"
    assert float(trailing["mars-ratelimit-reset-tokens"]) == 40.0
    usd = Budget("key", "usd_per_day", 5.0)
    spent = budgets.decide([usd], {"key": Use(usd_today=5.25)}, NOW).binding
    assert spent is not None
    assert spent.message() == "key budget of $5/day reached ($5.2500 used); frees at 2026-12-07T00:00:00Z"


def test_what_is_left_counts_the_turn_itself_and_the_headers_show_the_tightest() -> None:
    standings = budgets.decide(
        [Budget("user", "tokens_per_minute", 2000.0), Budget("key", "tokens_per_minute", 900.0)],
        {"user": Use(recent_tokens=((NOW - 30, 500.0),)), "key": Use()},
        NOW,
    ).standings
    after = tuple(budgets.after_turn(s, 300.0, 0.01, NOW) for s in standings)
    assert [s.remaining for s in after] == [1200.0, 600.0]
    assert [s.reset_in_s(NOW) for s in after] == [60.0, 60.0]  # this turn leaves the window last
    limits = rate_limits(after, NOW)
    assert [(r.budget, r.unit, r.limit, r.remaining) for r in limits] == [
        ("user_tokens_per_minute", "tokens", 2000.0, 1200.0),
        ("key_tokens_per_minute", "tokens", 900.0, 600.0),
    ]
    headers = mapping.ratelimit_headers(
        [
            *limits,
            svc.RateLimit(budget="user_usd_per_day", unit="usd", limit=1.5, remaining=0.25, reset_s=23400),
        ]
    )
    assert headers == {
        "x-ratelimit-limit-tokens": "900",
        "x-ratelimit-remaining-tokens": "600",
        "x-ratelimit-reset-tokens": "1m0s",
        "x-ratelimit-limit-usd": "1.5",
        "x-ratelimit-remaining-usd": "0.25",
        "x-ratelimit-reset-usd": "6h30m0s",
    }
    assert mapping.ratelimit_headers([]) == {}


def test_the_gateway_turns_a_refusals_metadata_into_headers() -> None:
    trailing = [
        ("retry-after-ms", "40000"),
        ("grpc-retry-pushback-ms", "-1"),
        ("mars-budget", "user_tokens_per_minute"),
        ("mars-ratelimit-limit-tokens", "2000"),
        ("mars-ratelimit-remaining-tokens", "0"),
        ("mars-ratelimit-reset-tokens", "40.000"),
    ]
    assert mapping.refusal_headers(trailing) == {
        "Retry-After": "40",
        "x-mars-budget": "user_tokens_per_minute",
        "x-ratelimit-limit-tokens": "2000",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "40s",
    }
    assert [mapping.duration(s) for s in (0.02, 6.5, 90, 3600 * 5 + 12)] == [
        "20ms",
        "6.5s",
        "1m30s",
        "5h0m12s",
    ]


class _Pool:
    """Stands in for the ingress's pool: answers the budget store's two reads, and counts them."""

    def __init__(self, rows: list[tuple[object, ...]]) -> None:
        self.rows = rows
        self.reads: list[str] = []

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[_Pool]:
        yield self

    async def execute(self, sql: str, params: object) -> _Pool:
        self.reads.append("exists" if sql == budget_store.HAS_BUDGETS_SQL else "rows")
        return self

    async def fetchone(self) -> tuple[bool]:
        return (bool(self.rows),)

    async def fetchall(self) -> list[tuple[object, ...]]:
        return self.rows


def test_the_store_reads_a_tenant_without_budgets_once_per_cache_time() -> None:
    clock = [0.0]
    empty = _Pool([])
    store = budget_store.BudgetStore(empty, 5.0, lambda: clock[0])  # type: ignore[arg-type]
    for user in ("u1", "u2", "u3"):
        assert asyncio.run(store.rows(T, user, "k1")) == []
    assert empty.reads == ["exists"]
    clock[0] = 6.0
    asyncio.run(store.rows(T, "u1", "k1"))
    assert empty.reads == ["exists", "exists"]
    held = _Pool([(T, "alice", "*", False, None, 100)])
    store = budget_store.BudgetStore(held, 5.0, lambda: clock[0])  # type: ignore[arg-type]
    for _ in range(2):
        assert asyncio.run(store.rows(T, "alice", None)) == [BudgetRow(T, "alice", tokens_per_minute=100)]
    assert held.reads == ["exists", "rows"]
    store.forget_user(T, "alice")  # a forgotten user's rows are read again (and found gone)
    asyncio.run(store.rows(T, "alice", None))
    assert held.reads == ["exists", "rows", "rows"]
