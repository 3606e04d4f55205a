"""Who calls and whether their turn may go in: API keys (mars.auth), scope, validation, the budgets of its
user and key (mars_ingress.budgets) and the tenant's quotas. Everything here answers before anything is
written; failures are RpcRefusals with their status."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
from mars import auth, metrics
from mars.auth import AuthError, KeyVerifier, PermissionDenied, Principal
from mars.domain.text import control_character
from mars.domain.turn_options import InvalidOption, parse_turn_options
from mars.runtime import InvalidRequest, RpcRefusal
from mars.tokens import load_counter
from mars.v1 import services_pb2 as svc
from psycopg_pool import AsyncConnectionPool

from mars_ingress import budgets, history
from mars_ingress.budget_store import BudgetStore
from mars_ingress.quota import (
    Headroom,
    Quotas,
    Refusal,
    SpendCache,
    TenantLimits,
    pool_spend,
    spend_refusal,
)
from mars_ingress.settings import IngressSettings

log = logging.getLogger(__name__)

_ID = auth.ID_PATTERN


class TurnFailed(RpcRefusal):
    """A turn (or call) that ends with a status for the caller (mars.runtime.RpcRefusal)."""


class InvalidTurn(InvalidRequest):
    """Bad input: INVALID_ARGUMENT with this message, before anything is written."""


def check_no_control(field_name: str, value: str) -> None:
    """InvalidTurn when `value` holds a C0 control character other than tab, newline or return."""
    found = control_character(value)
    if found is not None:
        raise InvalidTurn(
            f"{field_name} contains the control character U+{ord(value[found]):04X} at position "
            f"{found}; only tab, newline and carriage return are allowed"
        )


def check_fields(**fields: str) -> None:
    """`check_no_control` on each named field of a request."""
    for field_name, value in fields.items():
        check_no_control(field_name, value)


def check_user_ids(tenant: str, user_id: str) -> None:
    """InvalidTurn unless both ids are usable (an administrative call names its user exactly)."""
    for field_name, value in (("tenant", tenant), ("user_id", user_id)):
        check_no_control(field_name, value)
        if not _ID.match(value):
            raise InvalidTurn(f"{field_name} must match {_ID.pattern}")


def check_feedback(request: svc.FeedbackRequest, max_chars: int) -> None:
    """InvalidTurn unless the feedback names a turn with usable ids and a comment within the turn limit (a
    longer one would be dead-lettered by the stages)."""
    check_fields(
        tenant=request.tenant, user_id=request.user_id, turn_id=request.turn_id, comment=request.comment
    )
    if not request.turn_id:
        raise InvalidTurn("turn_id is required")
    if len(request.comment) > max_chars:
        raise InvalidTurn(f"comment has {len(request.comment)} characters; the limit is {max_chars}")


def validate_turn(req: svc.TurnRequest, max_chars: int) -> dict[str, str]:
    """Bad input gets INVALID_ARGUMENT before anything is written."""
    check_fields(tenant=req.tenant, user_id=req.user_id, session_id=req.session_id, text=req.text)
    if not req.tenant.strip():
        raise InvalidTurn("tenant is required")
    if not req.user_id.strip():
        raise InvalidTurn("user_id is required")
    check_user_ids(req.tenant, req.user_id)
    if req.session_id and not _ID.match(req.session_id):
        raise InvalidTurn(f"session_id must match {_ID.pattern}")
    if not req.text.strip():
        raise InvalidTurn("text is empty")
    if len(req.text) > max_chars:
        raise InvalidTurn(f"text has {len(req.text)} characters; the limit is {max_chars}")
    try:
        parse_turn_options(req.options)
        history.check_turn_history(req.history, req.session_id or "default", max_chars)
    except (InvalidOption, history.InvalidHistory) as exc:
        raise InvalidTurn(str(exc)) from None
    return dict(req.options)


def auth_failure(exc: AuthError) -> TurnFailed:
    code = (
        grpc.StatusCode.PERMISSION_DENIED
        if isinstance(exc, PermissionDenied)
        else grpc.StatusCode.UNAUTHENTICATED
    )
    return TurnFailed(code, str(exc))


def quota_failure(refusal: Refusal) -> TurnFailed:
    """RESOURCE_EXHAUSTED with the wait in the message and in trailing metadata `retry-after-ms`; a pushback
    of -1 tells gRPC's own retries (mars_ingress.client) not to send it again: the wait may be hours. A
    rate bucket's refusal adds its figures (mars-ratelimit-*-requests or -tokens)."""
    figures = () if refusal.headroom is None else ratelimit_metadata(quota_limit(refusal.headroom))
    return TurnFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        refusal.message,
        trailing=(
            ("retry-after-ms", str(refusal.retry_after_ms)),
            ("grpc-retry-pushback-ms", "-1"),
            *figures,
        ),
    )


#: Trailing metadata of a refusal by a budget or a tenant's rate quota: the budget that binds
#: (mars.metrics.BUDGET_KINDS), and for its unit (tokens, usd, requests) `mars-ratelimit-limit-<unit>`,
#: `-remaining-<unit>` and `-reset-<unit>` (seconds until it has room again).
BUDGET_KEY = "mars-budget"
RATELIMIT_PREFIX = "mars-ratelimit-"


def rate_limits(standings: tuple[budgets.Standing, ...], now: float) -> list[svc.RateLimit]:
    """The budgets' standings as the caller is told them (TurnReply.rate_limits)."""
    return [
        svc.RateLimit(
            budget=s.budget.label,
            unit=s.budget.unit,
            limit=s.budget.limit,
            remaining=s.remaining,
            reset_s=round(s.reset_in_s(now), 3),
        )
        for s in standings
    ]


def quota_limit(headroom: Headroom) -> svc.RateLimit:
    return svc.RateLimit(
        budget=headroom.name,
        unit=headroom.unit,
        limit=headroom.limit,
        remaining=headroom.remaining,
        reset_s=round(headroom.reset_s, 3),
    )


def ratelimit_metadata(limit: svc.RateLimit) -> tuple[tuple[str, str], ...]:
    return (
        (f"{RATELIMIT_PREFIX}limit-{limit.unit}", f"{limit.limit:.10g}"),
        (f"{RATELIMIT_PREFIX}remaining-{limit.unit}", f"{limit.remaining:.10g}"),
        (f"{RATELIMIT_PREFIX}reset-{limit.unit}", f"{limit.reset_s:.3f}"),
    )


def budget_failure(verdict: budgets.Verdict, now: float) -> TurnFailed:
    """RESOURCE_EXHAUSTED naming the budget, its limit and when it frees up; in trailing metadata the wait
    (`retry-after-ms`, and a pushback of -1: no automatic retry), the budget and its figures."""
    binding = verdict.binding
    assert binding is not None
    wait_ms = max(1, int(binding.reset_in_s(now) * 1000 + 0.999))
    return TurnFailed(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        binding.message(),
        trailing=(
            ("retry-after-ms", str(wait_ms)),
            ("grpc-retry-pushback-ms", "-1"),
            (BUDGET_KEY, binding.budget.label),
            *ratelimit_metadata(rate_limits((binding,), now)[0]),
        ),
    )


@dataclass(frozen=True)
class Admitted:
    """A turn let in: its options, the key it came with, its text's estimated tokens, and its budgets'
    standings when it was let in."""

    options: dict[str, str]
    key_id: str | None = None
    text_tokens: int = 0
    standings: tuple[budgets.Standing, ...] = ()
    #: The tenant's rate buckets in this process once the turn was taken from them.
    quota_limits: tuple[svc.RateLimit, ...] = ()

    @property
    def limited(self) -> bool:
        return bool(self.standings or self.quota_limits)

    def rate_limits(self, tokens: float, usd: float) -> list[svc.RateLimit]:
        """What is left once the turn's own `tokens` and `usd` are counted (budgets), and of the tenant's
        buckets as the turn left them."""
        now = time.time()
        after = tuple(budgets.after_turn(s, tokens, usd, now) for s in self.standings)
        return [*rate_limits(after, now), *self.quota_limits]


def admin_tenant(principal: Principal | None, tenant: str, action: str = "forgetting a user") -> str:
    """The tenant an administrative call acts on: the key's (a request naming another is PermissionDenied),
    and only with an admin key that is not limited to one user. No principal (auth off): the request's."""
    if principal is None:
        if not tenant:
            raise InvalidTurn("tenant is required")
        return tenant
    if not principal.admin or principal.user_id is not None:
        raise PermissionDenied(
            f"API key {principal.key_id} is not an admin key of tenant {principal.tenant!r}; "
            f"{action} takes one (`mars tenant create --admin`)"
        )
    tenant, _ = auth.authorize(principal, tenant, "")
    return tenant


def admin_target(principal: Principal | None, tenant: str, user_id: str, action: str) -> str:
    """`admin_tenant` for a call on one user, whose ids are checked too; a key that may not make the call
    is TurnFailed (PERMISSION_DENIED), bad ids InvalidTurn."""
    try:
        tenant = admin_tenant(principal, tenant, action)
    except AuthError as exc:
        raise auth_failure(exc) from None
    check_user_ids(tenant, user_id)
    return tenant


class Admission:
    """The ingress's gate: key verification (cached), budgets per user and per key, per-tenant rate, token
    and spend quotas."""

    def __init__(self, settings: IngressSettings, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._keys = KeyVerifier(auth.pool_lookup(pool), settings.auth_cache_ttl_s)
        self._quotas = Quotas(
            TenantLimits(
                turns_per_s=settings.quota_turns_per_s,
                turn_burst=settings.quota_turn_burst,
                tokens_per_min=settings.quota_tokens_per_min,
                usd_per_day=settings.quota_usd_per_day,
            ),
            settings.quota_tenants,
            settings.quota_replicas,
        )
        self._spend = SpendCache(pool_spend(pool), settings.quota_spend_cache_s, time.monotonic)
        self._budgets = BudgetStore(pool, settings.quota_budget_cache_s)
        self._count_tokens = load_counter(None)

    def forget_user(self, tenant: str, user_id: str) -> None:
        """The forgotten user's keys (deleted) stop working here now, not after the cache TTL; their
        budgets (deleted) likewise."""
        self._keys.forget_user(tenant, user_id)
        self._budgets.forget_user(tenant, user_id)

    async def authenticated(self, metadata: object) -> Principal | None:
        """`_authenticate` for a turn: a refused key is counted as a rejected turn (no tenant label)."""
        try:
            return await self.authenticate(metadata)
        except Exception:
            metrics.record_turn("rejected", "")
            raise

    async def authenticate(self, metadata: object) -> Principal | None:
        """The principal of the call's API key (None when auth is off); TurnFailed otherwise."""
        if not self._settings.auth_required:
            return None
        try:
            key = auth.bearer_token(metadata)  # type: ignore[arg-type]
            return await self._keys.verify(key)
        except AuthError as exc:
            raise auth_failure(exc) from None

    def check(self, req: svc.TurnRequest, principal: Principal | None) -> dict[str, str]:
        """Scope and validation of one turn, with nothing read or taken; fills the tenant (and a user-scoped
        key's user) from the key into `req`, and returns the turn's options."""
        if principal is not None:
            try:
                req.tenant, req.user_id = auth.authorize(principal, req.tenant, req.user_id)
            except AuthError as exc:
                raise auth_failure(exc) from None
        return validate_turn(req, self._settings.max_text_chars)

    async def admit(
        self, req: svc.TurnRequest, principal: Principal | None, options: dict[str, str]
    ) -> Admitted:
        """Budgets and quotas of a turn that passed `check` (its `options`). Budgets first: a turn they refuse
        takes nothing from the tenant's buckets."""
        text_tokens = self._count_tokens(req.text)
        key_id = principal.key_id if principal is not None else None
        standings = await self._check_budgets(req, key_id, principal)
        limits = self._quotas.limits(req.tenant)
        tokens_asked = text_tokens if limits.tokens_per_min > 0 else 0
        taken_at = time.monotonic()
        refusal = self._quotas.admit(req.tenant, tokens_asked, taken_at)
        limit_usd = limits.usd_per_day
        if refusal is None and limit_usd > 0:
            refusal = spend_refusal(
                req.tenant, await self._spend.spent(req.tenant), limit_usd, datetime.now(UTC)
            )
        if refusal is not None:
            log.info("turn of tenant %s refused: %s", req.tenant, refusal.message)
            raise quota_failure(refusal)
        quota_limits = tuple(quota_limit(h) for h in self._quotas.headroom(req.tenant, taken_at))
        return Admitted(options, key_id, text_tokens, standings, quota_limits)

    async def _check_budgets(
        self, req: svc.TurnRequest, key_id: str | None, principal: Principal | None
    ) -> tuple[budgets.Standing, ...]:
        """The standings of the user's and the key's budgets (mars_ingress.budgets); TurnFailed when one is
        spent. Nothing is read beyond the cached rows when none applies."""
        rows = await self._budgets.rows(req.tenant, req.user_id, key_id)
        applying = budgets.applicable(rows, req.user_id, key_id)
        if not applying:
            return ()
        scopes = {b.scope for b in applying}
        uses, now = await self._budgets.uses(
            req.tenant,
            req.user_id if "user" in scopes else None,
            key_id if "key" in scopes else None,
        )
        verdict = budgets.decide(applying, uses, now)
        if verdict.binding is not None:
            # The authenticated tenant only, and the budget's kind: never the user or the key.
            metrics.record_budget_refused(
                principal.tenant if principal is not None else "", verdict.binding.budget.label
            )
            log.info("turn of tenant %s refused: %s", req.tenant, verdict.binding.message())
            raise budget_failure(verdict, now)
        return verdict.standings

    def charge_imported(self, tenant: str, pairs: list[history.ImportedPair]) -> None:
        """Imported text is the tenant's text too: it counts against a token quota."""
        if self._quotas.limits(tenant).tokens_per_min > 0:
            tokens = sum(
                self._count_tokens(p.user_text) + self._count_tokens(p.assistant_text) for p in pairs
            )
            self._quotas.charge_tokens(tenant, tokens, time.monotonic())
