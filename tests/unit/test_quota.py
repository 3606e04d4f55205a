"""Token buckets and the per-tenant quota decisions, on a fake clock."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from mars_ingress.quota import (
    Quotas,
    SpendCache,
    TenantLimits,
    TokenBucket,
    seconds_to_utc_midnight,
    spend_refusal,
)


def test_bucket_starts_full_refills_at_its_rate_and_caps_at_capacity() -> None:
    b = TokenBucket(rate=2.0, capacity=3.0)
    for _ in range(3):
        assert b.wait_s(1, now=0.0) == 0
        b.take(1, now=0.0)
    assert b.wait_s(1, now=0.0) == pytest.approx(0.5)
    assert b.wait_s(1, now=0.5) == 0
    assert b.wait_s(3, now=100.0) == 0 and b.tokens == 3.0  # never above capacity


def test_a_take_larger_than_the_capacity_goes_into_debt() -> None:
    b = TokenBucket(rate=10.0, capacity=100.0)
    assert b.wait_s(250, now=0.0) == 0  # from a full bucket: allowed
    b.take(250, now=0.0)
    assert b.wait_s(1, now=0.0) == pytest.approx(15.1)  # pays back 150 + 1 at 10/s


def test_turn_rate_per_tenant_with_burst() -> None:
    q = Quotas(TenantLimits(turns_per_s=2, turn_burst=4))
    assert all(q.admit("a", 10, now=0.0) is None for _ in range(4))
    refusal = q.admit("a", 10, now=0.0)
    assert refusal is not None and refusal.limit == "rate"
    assert refusal.retry_after_ms == 500 and "2 turns/s" in refusal.message and "500 ms" in refusal.message
    assert q.admit("b", 10, now=0.0) is None  # tenants have their own buckets
    assert q.admit("a", 10, now=0.5) is None


def test_token_rate_counts_text_tokens_and_refusal_takes_nothing() -> None:
    q = Quotas(TenantLimits(turns_per_s=100, turn_burst=2, tokens_per_min=600))  # 10 tokens/s
    assert q.admit("a", 590, now=0.0) is None
    refusal = q.admit("a", 20, now=0.0)
    assert refusal is not None and "600 text tokens/min" in refusal.message
    assert refusal.retry_after_s == pytest.approx(1.0)
    # The refused turn took no turn token: one of the burst of 2 is still there.
    assert q.admit("a", 1, now=0.0) is None


def test_imported_history_is_charged_after_admission_into_debt() -> None:
    q = Quotas(TenantLimits(tokens_per_min=600))  # 10 tokens/s
    assert q.admit("a", 10, now=0.0) is None
    q.charge_tokens("a", 1000, now=0.0)  # the turn's earlier messages, imported with it
    refusal = q.admit("a", 10, now=0.0)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(42.0)  # (1010 - 600 + 10) / 10
    q.charge_tokens("b", 1000, now=0.0)  # a tenant without a bucket yet: nothing to charge
    assert q.admit("b", 10, now=0.0) is None
    unlimited = Quotas(TenantLimits())
    unlimited.charge_tokens("a", 10**9, now=0.0)
    assert unlimited.admit("a", 10, now=0.0) is None


def test_overrides_and_unlimited_defaults() -> None:
    q = Quotas(TenantLimits(), {"small": TenantLimits(turns_per_s=1)})
    assert all(q.admit("big", 10_000, now=0.0) is None for _ in range(1000))
    assert q.admit("small", 1, now=0.0) is None
    assert q.admit("small", 1, now=0.0) is not None


def test_replicas_share_the_limit() -> None:
    q = Quotas(TenantLimits(turns_per_s=10, turn_burst=10), replicas=2)
    admitted = sum(q.admit("a", 1, now=0.0) is None for _ in range(20))
    assert admitted == 5  # this process's half of the burst


def test_spend_limit_resets_at_utc_midnight() -> None:
    now = datetime(2025, 3, 1, 23, 0, tzinfo=UTC)
    assert seconds_to_utc_midnight(now) == 3600
    assert spend_refusal("a", 0.99, 1.0, now) is None
    assert spend_refusal("a", 5.0, 0.0, now) is None  # 0: unlimited
    refusal = spend_refusal("a", 1.0, 1.0, now)
    assert refusal is not None and refusal.retry_after_ms == 3_600_000
    assert "daily limit is $1" in refusal.message and "00:00 UTC" in refusal.message


def test_spend_cache_asks_once_per_ttl() -> None:
    asked: list[str] = []
    now = [0.0]

    async def fetch(tenant: str) -> float:
        asked.append(tenant)
        return 0.5 * len(asked)

    cache = SpendCache(fetch, ttl_s=5.0, clock=lambda: now[0])

    async def run() -> None:
        assert await cache.spent("a") == 0.5
        assert await cache.spent("a") == 0.5
        now[0] = 5.1
        assert await cache.spent("a") == 1.0

    asyncio.run(run())
    assert asked == ["a", "a"]


def test_the_tenants_buckets_are_told_as_requests_and_tokens_left() -> None:
    """What TurnReply.rate_limits (and the gateway's x-ratelimit-*-requests) say of a tenant's buckets: the
    capacity, what is left after the turn, and when the bucket is full again; a refusal carries its bucket."""
    from mars_ingress.admission import quota_failure

    q = Quotas(TenantLimits(turns_per_s=0.5, turn_burst=2, tokens_per_min=600))
    assert q.headroom("a", now=0.0) == []  # nothing taken yet: no bucket
    assert q.admit("a", 100, now=0.0) is None
    turns, tokens = q.headroom("a", now=0.0)
    assert (turns.name, turns.unit, turns.limit, turns.remaining) == ("tenant_turns_per_s", "requests", 2, 1)
    assert turns.reset_s == pytest.approx(2.0)  # one turn back at 0.5/s
    assert (tokens.unit, tokens.limit, tokens.remaining, tokens.reset_s) == ("tokens", 600, 500, 10.0)
    assert q.admit("a", 100, now=0.0) is None
    refusal = q.admit("a", 100, now=0.0)
    assert refusal is not None and refusal.headroom is not None and refusal.headroom.remaining == 0
    trailing = dict(quota_failure(refusal).trailing)
    assert trailing["mars-ratelimit-limit-requests"] == "2"
    assert trailing["mars-ratelimit-remaining-requests"] == "0"
    assert float(trailing["mars-ratelimit-reset-requests"]) == pytest.approx(4.0)
