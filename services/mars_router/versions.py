"""Which policy version routes a tenant's turns, which one runs in shadow beside it, and which one routes a
share of its sessions as a canary (issue 47).

Versions and roles live in router_policy_versions / router_policy_roles (mars_router.policy_admin changes
them). Every router replica reads a tenant's roles at most once per MARS_ROUTER_POLICY_CONFIG_TTL_S (0.5 s by
default) and caches them that long, so a promote or a rollback routes every replica's turns within about that
time plus one read (under a second), at the cost of two small queries per tenant and second. A tenant without
a live row routes by the implicit version "default": the router's own settings, its matrices under the bare
policy id, as before versions existed.

A version's matrices are router_arms rows under its own policy id, the scope's id with "#v=<version>" after
it (`versioned_policy_id`), so a version starts cold, learns apart from the others, and is forgotten with the
user's policy (mars.forget matches "user:tenant/user#...")."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mars.domain.bandits import RoutingPolicy
from mars.domain.policy_versions import DEFAULT_VERSION, PolicyConfig, PolicyConfigError
from mars.ttl_cache import TtlCache
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_tables import PolicyTables, policy_id_for
from mars_router.settings import RouterSettings

log = logging.getLogger(__name__)

ROLES_SQL = (
    "SELECT r.role, v.version, v.algorithm, v.params, v.feature_set, v.lambda_cost, v.arms "
    "FROM router_policy_roles r JOIN router_policy_versions v USING (tenant, version) WHERE r.tenant = %s"
)


def versioned_policy_id(base: str, version: str) -> str:
    """The policy id a version's matrices are kept under: the scope's id for "default", else
    "<id>#v=<version>"."""
    return base if version == DEFAULT_VERSION else f"{base}#v={version}"


def config_of_row(row: Sequence[Any]) -> PolicyConfig:
    """A PolicyConfig from (algorithm, params, feature_set, lambda_cost, arms) columns."""
    algorithm, params, feature_set, lambda_cost, arms = row
    return PolicyConfig(str(algorithm), tuple(arms), dict(params), str(feature_set), lambda_cost)


@dataclass(frozen=True)
class VersionPolicy:
    """One version as the router runs it: its bandit, its tables and the feature space it routes on."""

    version: str
    #: None for the implicit "default" (the router's settings).
    config: PolicyConfig | None
    routing: RoutingPolicy
    tables: PolicyTables
    feature_space: str
    dim: int
    arms: tuple[str, ...]
    #: The cost weight of this version's reward; None: the judge's.
    lambda_cost: float | None

    def policy_id(self, scope: str, tenant: str, user_id: str) -> str:
        return versioned_policy_id(policy_id_for(scope, tenant, user_id, self.feature_space), self.version)


def build_version(
    pool: AsyncConnectionPool, settings: RouterSettings, version: str, config: PolicyConfig
) -> VersionPolicy:
    """A stored version's runtime. Its matrices start cold with its own ridge (never warm-started from the
    tenant's default policy, whose matrices another config learned)."""
    tables_settings = settings.model_copy(
        update={
            "alpha": config.params.get("alpha", settings.alpha),
            "ridge": config.params["ridge"],
            "warm_start_from_tenant": False,
        }
    )
    return VersionPolicy(
        version,
        config,
        config.routing_policy(settings.routing_seed),
        PolicyTables(pool, tables_settings, list(config.arms), config.feature_set, config.dim),
        config.feature_set,
        config.dim,
        config.arms,
        config.lambda_cost,
    )


@dataclass(frozen=True)
class TenantPolicies:
    """A tenant's versions by role, as read (config None for the implicit "default" live version)."""

    live_version: str = DEFAULT_VERSION
    live: PolicyConfig | None = None
    shadow_version: str | None = None
    shadow: PolicyConfig | None = None
    #: The canary run's candidate (mars_router.rollouts): it routes a share of the tenant's sessions.
    canary_version: str | None = None
    canary: PolicyConfig | None = None


class PolicyVersions:
    """The tenants' roles, each read at most once per TTL by this replica."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        ttl_s: float,
        known_arms: Sequence[str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._known_arms = list(known_arms)
        self._clock = clock
        self._cache: TtlCache[str, TenantPolicies] = TtlCache(ttl_s)
        #: Reads of the roles table (for tests and metrics: one per tenant per TTL at most).
        self.reads = 0

    def invalidate(self, tenant: str | None = None) -> None:
        if tenant is None:
            self._cache.clear()
        else:
            self._cache.pop(tenant)

    async def resolve(self, tenant: str) -> TenantPolicies:
        now = self._clock()
        cached = self._cache.get(tenant, now)
        if cached is not None:
            return cached
        async with self._pool.connection() as conn:
            cur = await conn.execute(ROLES_SQL, (tenant,))
            rows = await cur.fetchall()
        self.reads += 1
        resolved = self._of_rows(tenant, rows)
        self._cache.put(tenant, resolved, now)
        return resolved

    def _of_rows(self, tenant: str, rows: Sequence[Sequence[Any]]) -> TenantPolicies:
        found: dict[str, tuple[str, PolicyConfig]] = {}
        for role, version, *config_row in rows:
            try:
                config = config_of_row(config_row)
                config.check_arms(self._known_arms)
            except PolicyConfigError as exc:
                # Never route by a version this replica cannot run: the live falls back to "default".
                log.error(
                    "tenant %s: policy version %s (%s) is unusable here: %s", tenant, version, role, exc
                )
                continue
            found[str(role)] = (str(version), config)
        live = found.get("live")
        shadow = found.get("shadow")
        canary = found.get("canary")
        return TenantPolicies(
            live[0] if live else DEFAULT_VERSION,
            live[1] if live else None,
            shadow[0] if shadow else None,
            shadow[1] if shadow else None,
            canary[0] if canary else None,
            canary[1] if canary else None,
        )
