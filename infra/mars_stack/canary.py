"""A canary run for a tenant, as an operator starts one with `mars policy create|activate|canary`: used by
the suites whose dashboards query the router's canary series (mars.rollout.*), which only a tenant with a
running canary feeds."""

from __future__ import annotations

import time
from collections.abc import Sequence

import psycopg
from mars.domain.policy_versions import PolicyConfig
from mars.domain.rollout import RolloutState
from mars_router import policy_admin
from mars_router.settings import RouterSettings


def start_canary_run(dsn: str, tenant: str, arms: Sequence[str], actor: str = "tests") -> None:
    """A live LinUCB version and an epsilon-greedy candidate over the whole pool `arms`, the candidate in a
    canary run from a fresh test state. Too few turns follow in a suite for the run to decide (the default
    warm-up), so routing stays as it was. Returns once every router replica sees the run: a replica may hold
    the tenant's roles from earlier turns for its roles TTL (MARS_ROUTER_POLICY_CONFIG_TTL_S)."""
    arms = list(arms)
    with psycopg.connect(dsn, autocommit=True) as conn:
        live = policy_admin.create_version(conn, tenant, PolicyConfig("linucb", tuple(arms)), arms)
        policy_admin.activate(conn, tenant, live.version, actor)
        candidate = policy_admin.create_version(
            conn, tenant, PolicyConfig("epsilon_greedy", tuple(arms), {"epsilon": 0.1}), arms
        )
        policy_admin.set_canary(conn, tenant, candidate.version, RolloutState().to_dict(), actor)
    time.sleep(2 * RouterSettings.model_fields["policy_config_ttl_s"].default)


def rollout_turns(dsn: str, tenant: str) -> int:
    """The judged turns the tenant's canary runs have counted (router_rollouts)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(turns), 0) FROM router_rollouts WHERE tenant = %s", (tenant,)
        ).fetchone()
    return int(row[0]) if row else 0
