"""Budgets per end user and per API key, beside the tenant's quotas (mars_ingress.quota): USD per UTC day and
tokens per sliding minute, set with `mars tenant set-budget` and held in `ingress_budgets`
(mars_ingress.budget_store reads them and the use they are checked against).

Which budgets apply to a turn of (tenant, user, key):
  - the user's: the user's own row (tenant, user, '*'), limit by limit, else the tenant's default for each
    user (tenant, '*', '*', each_user) - a limit the user's row leaves empty is the default's;
  - the key's: (tenant, '*', key), for turns made with that key.
Every one that applies must have room; the one that frees up last binds.

A budget has room while its use is below its limit; the turn that crosses it is let in and its tokens or
cost are debt, so a burst overshoots by at most what the turns already in flight use. A turn counts its
text's estimated tokens when admitted and the answering call's prompt + answer tokens once answered; its
cost once the judge has priced it (as the tenant's daily spend does).

Pure: the clock (epoch seconds) and the use are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

#: '*' in a row's user_id or key_id: "not this dimension" (no id matches it: mars.auth.ID_PATTERN).
ANY = "*"
#: The sliding window of a tokens-per-minute budget.
WINDOW_S = 60.0

Scope = Literal["user", "key"]
Kind = Literal["usd_per_day", "tokens_per_minute"]
KINDS: tuple[Kind, ...] = ("usd_per_day", "tokens_per_minute")
#: What each kind is counted in: the suffix of the x-ratelimit-* headers and mars-ratelimit-* metadata.
UNITS: dict[Kind, str] = {"usd_per_day": "usd", "tokens_per_minute": "tokens"}


@dataclass(frozen=True)
class BudgetRow:
    """One row of ingress_budgets. None: no limit of that kind."""

    tenant: str
    user_id: str = ANY
    key_id: str = ANY
    each_user: bool = False
    usd_per_day: float | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.user_id != ANY and self.key_id != ANY:
            raise ValueError("a budget is per user or per key, not both")
        if self.each_user != (self.user_id == ANY and self.key_id == ANY):
            raise ValueError("a budget names a user, a key, or is the default for each user")
        if self.usd_per_day is None and self.tokens_per_minute is None:
            raise ValueError("a budget sets --usd-per-day, --tokens-per-minute or both")
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{kind} must be a finite number >= 0, got {value}")

    @property
    def scope(self) -> str:
        return scope_name(self.user_id, self.key_id)


def scope_name(user_id: str, key_id: str) -> str:
    """How `mars tenant budgets` names a budget's owner: "user U", "key K" or "each user"."""
    if user_id != ANY:
        return f"user {user_id}"
    return f"key {key_id}" if key_id != ANY else "each user"


@dataclass(frozen=True)
class Budget:
    """One limit that applies to a turn."""

    scope: Scope
    kind: Kind
    limit: float
    #: A user budget that is the tenant's default for each user, not the user's own.
    default: bool = False

    @property
    def label(self) -> str:
        """Scope and kind (mars.metrics.BUDGET_KINDS), e.g. "user_tokens_per_minute": never whose it is."""
        return f"{self.scope}_{self.kind}"

    @property
    def unit(self) -> str:
        return UNITS[self.kind]

    def describe(self) -> str:
        """E.g. "user budget of 2000 tokens/min", "key budget of $5/day"."""
        amount = f"${self.limit:g}/day" if self.kind == "usd_per_day" else f"{self.limit:g} tokens/min"
        whose = "user budget (the tenant's default for each user)" if self.default else f"{self.scope} budget"
        return f"{whose} of {amount}"


def applicable(rows: Iterable[BudgetRow], user_id: str, key_id: str | None) -> list[Budget]:
    """The budgets of a turn by `user_id` made with the key `key_id` (None: no key, auth off), from the rows
    of its tenant (others are ignored)."""
    own: BudgetRow | None = None
    default: BudgetRow | None = None
    key: BudgetRow | None = None
    for row in rows:
        if row.each_user:
            default = row
        elif row.user_id != ANY and row.user_id == user_id:
            own = row
        elif row.key_id != ANY and row.key_id == key_id:
            key = row
    found: list[Budget] = []
    for kind in KINDS:
        mine = getattr(own, kind) if own is not None else None
        fallback = getattr(default, kind) if default is not None else None
        if mine is not None:
            found.append(Budget("user", kind, float(mine)))
        elif fallback is not None:
            found.append(Budget("user", kind, float(fallback), default=True))
    if key is not None:
        found.extend(
            Budget("key", kind, float(getattr(key, kind))) for kind in KINDS if getattr(key, kind) is not None
        )
    return found


@dataclass(frozen=True)
class Use:
    """What one user or key has used: the judged cost of its turns since 00:00 UTC, and its turns' tokens
    in the last minute as (epoch seconds, tokens), oldest first."""

    usd_today: float = 0.0
    recent_tokens: tuple[tuple[float, float], ...] = ()

    def tokens_in_window(self, now: float) -> float:
        return sum(n for t, n in self.recent_tokens if t > now - WINDOW_S)


def day_end(now: float) -> float:
    """The next 00:00 UTC after `now` (epoch seconds): when a USD-per-day budget starts over."""
    today = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return (today + timedelta(days=1)).timestamp()


def tokens_free_at(recent: Sequence[tuple[float, float]], limit: float, now: float) -> float:
    """When the tokens in the sliding minute fall below `limit` (now, if they are): the oldest turns leave
    the window one by one, each WINDOW_S after it was made."""
    live = sorted((t, n) for t, n in recent if t > now - WINDOW_S)
    used = sum(n for _, n in live)
    if used < limit:
        return now
    for t, n in live:
        used -= n
        if used < limit:
            return t + WINDOW_S
    return now + WINDOW_S  # unreachable with limit > 0: all gone frees it


@dataclass(frozen=True)
class Standing:
    """One budget against its use now: how much is left, and when it frees up (refused) or is whole again
    (room left)."""

    budget: Budget
    used: float
    #: Epoch seconds: the time it has room again when exhausted; else when all of it is free again.
    reset_at: float

    @property
    def exhausted(self) -> bool:
        return self.used >= self.budget.limit

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget.limit - self.used)

    def reset_in_s(self, now: float) -> float:
        return max(0.0, self.reset_at - now)

    def message(self) -> str:
        used = f"${self.used:.4f}" if self.budget.kind == "usd_per_day" else f"{self.used:g} tokens"
        frees = datetime.fromtimestamp(self.reset_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"{self.budget.describe()} reached ({used} used); frees at {frees}"


def standing(budget: Budget, use: Use, now: float) -> Standing:
    if budget.kind == "usd_per_day":
        return Standing(budget, use.usd_today, day_end(now))
    used = use.tokens_in_window(now)
    if used >= budget.limit:
        return Standing(budget, used, tokens_free_at(use.recent_tokens, budget.limit, now))
    # Whole again once the newest turn in the window has left it.
    newest = max((t for t, _ in use.recent_tokens if t > now - WINDOW_S), default=now - WINDOW_S)
    return Standing(budget, used, newest + WINDOW_S)


@dataclass(frozen=True)
class Verdict:
    """Every applicable budget's standing, and the one that refuses the turn (None: let in)."""

    standings: tuple[Standing, ...]
    binding: Standing | None


def decide(budgets: Iterable[Budget], uses: Mapping[Scope, Use], now: float) -> Verdict:
    """Let the turn in while every budget has room; else refuse it by the exhausted budget that frees up
    last (trying again before then is refused anyway). `uses`: the turn's user's and key's."""
    standings = tuple(standing(b, uses.get(b.scope, Use()), now) for b in budgets)
    exhausted = [s for s in standings if s.exhausted]
    binding = max(exhausted, key=lambda s: s.reset_at) if exhausted else None
    return Verdict(standings, binding)


def after_turn(s: Standing, tokens: float, usd: float, now: float) -> Standing:
    """The standing once this turn's own tokens or cost (at `now`) are counted: what the caller is told is
    left, and when all of it is free again."""
    if s.budget.kind == "usd_per_day":
        return Standing(s.budget, s.used + max(0.0, usd), s.reset_at)
    if tokens <= 0:
        return s
    return Standing(s.budget, s.used + tokens, max(s.reset_at, now + WINDOW_S))
