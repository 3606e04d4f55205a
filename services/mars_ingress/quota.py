"""Per-tenant quotas at the ingress: token buckets for turns per second and text tokens per minute, and a
daily spend limit in USD.

Buckets live in each ingress process (no shared state on the answer path): with N replicas a tenant can
get up to N times its limits, unless `MARS_INGRESS_QUOTA_REPLICAS` is set to N, which gives each process 1/N of
them (exact when a load balancer spreads the tenant's calls evenly). Spend is the judged cost of the
tenant's turns since 00:00 UTC, read from Postgres and cached for a few seconds, so it is shared by all
replicas but may overshoot by what is spent within the cache time.

A value of 0 means unlimited. Everything here is pure (the clock is passed in) except `spent_today`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from mars.ttl_cache import TtlCache
from pydantic import BaseModel, Field


class TenantLimits(BaseModel):
    """One tenant's limits (0: unlimited). `turn_burst` 0: max(1, turns_per_s)."""

    turns_per_s: float = Field(default=0.0, ge=0)
    turn_burst: float = Field(default=0.0, ge=0)
    tokens_per_min: float = Field(default=0.0, ge=0)
    usd_per_day: float = Field(default=0.0, ge=0)


@dataclass
class TokenBucket:
    """`capacity` tokens, refilled at `rate` per second. A take larger than the capacity is allowed from
    a full bucket and leaves it in debt (negative), so one big request is not refused forever but pays
    for itself before the next one."""

    rate: float
    capacity: float
    tokens: float = math.nan
    updated: float = math.nan

    def _refill(self, now: float) -> None:
        if math.isnan(self.tokens):
            self.tokens, self.updated = self.capacity, now
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self.updated = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` can be taken (0: now). Does not take anything."""
        self._refill(now)
        need = min(n, self.capacity)
        if self.tokens >= need:
            return 0.0
        return (need - self.tokens) / self.rate

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.tokens -= n

    def level(self, now: float) -> tuple[float, float]:
        """(tokens left, seconds until the bucket is full again) at `now`."""
        self._refill(now)
        return self.tokens, max(0.0, (self.capacity - self.tokens) / self.rate)


@dataclass(frozen=True)
class Headroom:
    """One of a tenant's buckets in this process as the caller is told it (TurnReply.rate_limits): turns
    ("requests") or text tokens, its capacity, what is left and the seconds until it is full again."""

    name: str
    unit: str
    limit: float
    remaining: float
    reset_s: float


#: The name a tenant bucket of each unit goes by in TurnReply.rate_limits.
BUCKET_NAMES = {"requests": "tenant_turns_per_s", "tokens": "tenant_tokens_per_minute"}


def bucket_headroom(unit: str, bucket: TokenBucket, now: float) -> Headroom:
    left, full_in = bucket.level(now)
    return Headroom(BUCKET_NAMES[unit], unit, bucket.capacity, max(0.0, math.floor(left)), full_in)


@dataclass(frozen=True)
class Refusal:
    """Why a turn is refused and when to try again."""

    limit: str
    retry_after_s: float
    message: str
    #: The bucket that refused (a rate refusal), for the caller's rate-limit figures.
    headroom: Headroom | None = None

    @property
    def retry_after_ms(self) -> int:
        return max(1, math.ceil(self.retry_after_s * 1000))


@dataclass
class Quotas:
    """The rate limits of every tenant in this process."""

    defaults: TenantLimits
    overrides: Mapping[str, TenantLimits] = field(default_factory=dict)
    #: Ingress replicas sharing the limits: each process enforces 1/replicas of them.
    replicas: int = 1
    _turns: dict[str, TokenBucket] = field(default_factory=dict)
    _tokens: dict[str, TokenBucket] = field(default_factory=dict)

    def limits(self, tenant: str) -> TenantLimits:
        return self.overrides.get(tenant, self.defaults)

    def admit(self, tenant: str, text_tokens: int, now: float) -> Refusal | None:
        """Take one turn and `text_tokens` from the tenant's buckets, or say why not (taking nothing)."""
        limits = self.limits(tenant)
        share = 1.0 / max(1, self.replicas)
        buckets: list[tuple[TokenBucket, float, str]] = []
        if limits.turns_per_s > 0:
            rate = limits.turns_per_s * share
            burst = (limits.turn_burst or max(1.0, limits.turns_per_s)) * share
            bucket = self._turns.get(tenant)
            if bucket is None or bucket.rate != rate:
                bucket = self._turns[tenant] = TokenBucket(rate, max(1.0, burst))
            buckets.append((bucket, 1.0, f"{limits.turns_per_s:g} turns/s"))
        if limits.tokens_per_min > 0:
            rate = limits.tokens_per_min * share / 60.0
            bucket = self._tokens.get(tenant)
            if bucket is None or bucket.rate != rate:
                bucket = self._tokens[tenant] = TokenBucket(rate, limits.tokens_per_min * share)
            buckets.append((bucket, float(text_tokens), f"{limits.tokens_per_min:g} text tokens/min"))
        for bucket, n, what in buckets:
            wait = bucket.wait_s(n, now)
            if wait > 0:
                unit = "requests" if bucket is self._turns.get(tenant) else "tokens"
                return Refusal(
                    "rate",
                    wait,
                    f"tenant {tenant!r} is over its quota of {what}; retry in {math.ceil(wait * 1000)} ms",
                    bucket_headroom(unit, bucket, now),
                )
        for bucket, n, _ in buckets:
            bucket.take(n, now)
        return None

    def headroom(self, tenant: str, now: float) -> list[Headroom]:
        """The tenant's turn and token buckets in this process (those it has), after what was taken."""
        found = (("requests", self._turns.get(tenant)), ("tokens", self._tokens.get(tenant)))
        return [bucket_headroom(unit, bucket, now) for unit, bucket in found if bucket is not None]

    def charge_tokens(self, tenant: str, text_tokens: int, now: float) -> None:
        """Take `text_tokens` from the tenant's token bucket without refusing (it may go into debt, paid
        back before the next turn): text found to be new only after the turn was admitted, such as the
        earlier messages of a turn that MARS did not hold and imports with it."""
        limits = self.limits(tenant)
        bucket = self._tokens.get(tenant)
        if limits.tokens_per_min > 0 and bucket is not None and text_tokens > 0:
            bucket.take(float(text_tokens), now)


def seconds_to_utc_midnight(now: datetime) -> float:
    """Seconds from `now` (aware) to the next 00:00 UTC, when the daily spend starts over."""
    now = now.astimezone(UTC)
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - now).total_seconds()


def spend_refusal(tenant: str, spent_usd: float, limit_usd: float, now: datetime) -> Refusal | None:
    if limit_usd <= 0 or spent_usd < limit_usd:
        return None
    wait = seconds_to_utc_midnight(now)
    return Refusal(
        "spend",
        wait,
        f"tenant {tenant!r} has spent ${spent_usd:.4f} today, its daily limit is ${limit_usd:g}; "
        f"the limit resets at 00:00 UTC (in {wait / 3600:.1f} h)",
    )


#: The judged cost (generator + controller + judge) of a tenant's turns received since 00:00 UTC, as the
#: ingress recorded it from each turn's Judged event (`JUDGED_COST_SQL`): its own table, not the judge's.
SPENT_TODAY_SQL = (
    "SELECT coalesce(sum(cost_usd), 0) FROM ingress_turns "
    "WHERE tenant = %s AND created_at >= date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
)
#: A turn's cost from its first Judged event (later ones correct the reward, not the cost), as the judge
#: keeps its first verdict's costs.
JUDGED_COST_SQL = "UPDATE ingress_turns SET cost_usd = %s WHERE turn_id = %s AND cost_usd IS NULL"


JUDGED_COSTS = ("cost_usd", "controller_cost_usd", "judge_cost_usd")


def judged_cost(judged: Any) -> float:
    """What a turn cost by its Judged event (mars.v1.Judged): generator, controller and judge. ValueError
    names a component that is not a finite number >= 0 (a malformed event, dead-lettered)."""
    for name in JUDGED_COSTS:
        value = getattr(judged, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"judged {name} must be a finite number >= 0, got {value}")
    return float(sum(getattr(judged, name) for name in JUDGED_COSTS))


class SpendCache:
    """Each tenant's spend today, read through `fetch` at most once per `ttl_s`."""

    def __init__(
        self, fetch: Callable[[str], Awaitable[float]], ttl_s: float, clock: Callable[[], float]
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._cache: TtlCache[str, float] = TtlCache(ttl_s)

    async def spent(self, tenant: str) -> float:
        now = self._clock()
        hit = self._cache.get(tenant, now)
        if hit is not None:
            return hit
        value = await self._fetch(tenant)
        self._cache.put(tenant, value, now)
        return value


def pool_spend(pool: Any) -> Callable[[str], Awaitable[float]]:
    """A SpendCache fetch over a psycopg AsyncConnectionPool."""

    async def fetch(tenant: str) -> float:
        async with pool.connection() as conn:
            cur = await conn.execute(SPENT_TODAY_SQL, (tenant,))
            row = await cur.fetchone()
        return float(row[0]) if row else 0.0

    return fetch
