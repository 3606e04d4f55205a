"""Router policies: the routing side of a router's policies in Postgres, over the tables
(mars_router.policy_tables) and the reward updates (mars_router.rewards).

`PolicyStore` builds a turn's context vector, reads the policy it routes on, asks the routing policy
(mars.domain.bandits) for a decision, records it, and hands each judged reward to `RewardUpdates`. The
service module is the transport around it (Kafka stages and the gRPC servicer).

Policy versions (mars_router.versions): a tenant's live version decides (or its canary version, for the
sessions of the canary's share: `split`), its shadow version (if any) decides beside it on the same turn and
is recorded, never answered by. A tenant without versions routes by
the router's settings (the implicit version "default"), as before."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mars.domain.bandits import make_routing_policy, turn_rng, uses_query_features
from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM, featurize, phase_of, query_features
from mars.domain.linucb import ArmModel
from mars.domain.policy_versions import DEFAULT_VERSION, PolicyConfig
from mars.domain.rollout import in_canary
from mars.v1 import events_pb2 as ev
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_tables import PolicyCorrupt, PolicyRead, PolicyTables, policy_id_for
from mars_router.rewards import RewardUpdates
from mars_router.rollouts import Observed
from mars_router.settings import RouterSettings
from mars_router.versions import PolicyVersions, TenantPolicies, VersionPolicy, build_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteResult:
    arm: str
    scores: list[ev.ArmScore]
    policy_id: str
    version: int
    propensity: float
    previous_arm: str | None = None
    switch_penalty: float = 0.0
    #: The policy version that decided ("default": the router's settings) and its reward's cost weight.
    config_version: str = DEFAULT_VERSION
    lambda_cost: float | None = None


@dataclass(frozen=True)
class ShadowResult:
    """A shadow version's decision on a turn: logged beside the live one, never answered by."""

    version: str
    policy_id: str
    arm: str
    propensity: float
    #: The chosen arm's score (its UCB for LinUCB, its mean for the others).
    score: float
    x: np.ndarray
    lambda_cost: float | None


@dataclass(frozen=True)
class Split:
    """A turn's versions: the one that decides, the tenant's live and shadow ones, and its canary run's
    side ("live" or "canary"; "" without a canary) and candidate."""

    deciding: VersionPolicy
    live: VersionPolicy
    shadow: VersionPolicy | None
    role: str = ""
    canary_version: str | None = None


class PolicyStore:
    def __init__(self, pool: AsyncConnectionPool, settings: RouterSettings, arms: list[str]) -> None:
        self._pool = pool
        self._settings = settings
        self.arms = arms
        #: Which features this router's policies use: the state map (Table 7) or the query embedding.
        self.feature_space = "query" if uses_query_features(settings.routing_policy) else "state"
        self.dim = QUERY_FEATURE_DIM if self.feature_space == "query" else FEATURE_DIM
        self._warned_no_embedding = False
        self.routing = make_routing_policy(
            settings.routing_policy,
            arms,
            self.dim,
            settings.alpha,
            settings.ridge,
            settings.epsilon,
            settings.thompson_v,
            seed=settings.routing_seed,
        )
        #: MARS_ROUTER_ROUTING_SEED: per-turn seeded draws (None: OS entropy).
        self.seed = settings.routing_seed
        self.default_arm = settings.default_arm or arms[0]
        if self.default_arm not in arms:
            raise ValueError(f"default_arm {self.default_arm!r} is not in the model pool {arms}")
        self.tables = PolicyTables(pool, settings, arms, self.feature_space, self.dim)
        self.rewards = RewardUpdates(pool, settings, arms, self.dim, self.routing)
        #: The tenants' live and shadow versions (cached MARS_ROUTER_POLICY_CONFIG_TTL_S).
        self.versions = PolicyVersions(pool, settings.policy_config_ttl_s, arms)
        #: The implicit version of a tenant without versions: this router's settings, the bare policy ids.
        self.default_version = VersionPolicy(
            DEFAULT_VERSION, None, self.routing, self.tables, self.feature_space, self.dim, tuple(arms), None
        )
        self._runtimes: dict[tuple[str, str], VersionPolicy] = {}

    async def policies(self, tenant: str) -> tuple[VersionPolicy, VersionPolicy | None]:
        """The tenant's live version and its shadow version (None without one)."""
        return self._live_and_shadow(tenant, await self.versions.resolve(tenant))

    def _live_and_shadow(
        self, tenant: str, roles: TenantPolicies
    ) -> tuple[VersionPolicy, VersionPolicy | None]:
        live = self.default_version
        if roles.live is not None:
            live = self._runtime(tenant, roles.live_version, roles.live)
        shadow = None
        if roles.shadow is not None and roles.shadow_version is not None:
            shadow = self._runtime(tenant, roles.shadow_version, roles.shadow)
        return live, shadow

    async def split(self, tenant: str, session_id: str) -> Split:
        """Who decides a turn of the session: the tenant's canary version when it has one and the session is
        in its share (in_canary, salted with the candidate's id: every turn of a session, on every replica,
        gets the same side), else its live version; and its shadow beside either."""
        roles = await self.versions.resolve(tenant)  # one read of the roles for all three
        live, shadow = self._live_and_shadow(tenant, roles)
        if roles.canary is None or roles.canary_version is None:
            return Split(live, live, shadow)
        candidate = roles.canary_version
        if in_canary(tenant, session_id, self._settings.rollout_share, salt=candidate):
            return Split(self._runtime(tenant, candidate, roles.canary), live, shadow, "canary", candidate)
        return Split(live, live, shadow, "live", candidate)

    def _runtime(self, tenant: str, version: str, config: PolicyConfig) -> VersionPolicy:
        """A stored version's runtime, built once (versions are immutable)."""
        runtime = self._runtimes.get((tenant, version))
        if runtime is None or runtime.config != config:
            if len(self._runtimes) > 10_000:
                self._runtimes.clear()
            runtime = build_version(self._pool, self._settings, version, config)
            self._runtimes[(tenant, version)] = runtime
        return runtime

    @property
    def updates(self) -> bool:
        """False: a frozen policy (MARS_ROUTER_POLICY_UPDATES=false); rewards are recorded, never applied."""
        return self.rewards.updates

    def features(
        self,
        state: ev.SessionState,
        load: ev.ViewLoad,
        depth: int,
        query_embedding: Sequence[float],
        recent_phases: Sequence[int] = (),
        feature_space: str | None = None,
    ) -> np.ndarray:
        """The policy's context vector: the state feature map, or the projected query embedding (this
        router's feature space, or `feature_space`: a version's)."""
        if (feature_space or self.feature_space) == "query":
            if not query_embedding and not self._warned_no_embedding:
                self._warned_no_embedding = True
                log.warning(
                    "query-linucb got a view without a query embedding (set MARS_MEMORY_VIEW_QUERY_EMBEDDING=true "
                    "on the memory service); routing on the bias term alone"
                )
            return query_features(list(query_embedding))
        return featurize(state, load, depth, recent_phases)

    def policy_id(self, tenant: str, user_id: str, version: VersionPolicy | None = None) -> str:
        """The id of the policy that routes the user's turns (by MARS_ROUTER_POLICY_SCOPE and feature space;
        a stored version's matrices under its own id, mars_router.versions.versioned_policy_id)."""
        if version is not None:
            return version.policy_id(self._settings.policy_scope, tenant, user_id)
        return policy_id_for(self._settings.policy_scope, tenant, user_id, self.feature_space)

    async def read_for_turn(
        self, tenant: str, user_id: str, session_key: str, turn_id: str, version: VersionPolicy | None = None
    ) -> tuple[list[int], PolicyRead]:
        """For routing a turn, in one round trip: the phases of the session's last routed turns before it,
        oldest first (Table 7's recent revision / finalization flags, read back from the state features
        logged with each decision; none for a query-feature policy), and the user's policy (`version`'s)."""
        version = version or self.default_version
        read, rows = await version.tables.read(
            self.policy_id(tenant, user_id, version), (session_key, turn_id)
        )
        return [phase_of(list(row[0])) for row in reversed(rows)], read

    async def load(
        self, policy_id: str, version: VersionPolicy | None = None
    ) -> tuple[dict[str, ArmModel], int]:
        """The policy's arm models and its version (created when new; `version`'s tables, the router's
        when None); PolicyCorrupt when its matrices fail the sanity check."""
        read, _ = await (version or self.default_version).tables.read(policy_id, None)
        if read.corrupt is not None:
            raise PolicyCorrupt(read.corrupt)
        return read.models, read.version

    async def decide(
        self,
        tenant: str,
        user_id: str,
        x: np.ndarray,
        session_key: str | None = None,
        draw_key: str | None = None,
        policy: PolicyRead | None = None,
        live: VersionPolicy | None = None,
    ) -> RouteResult:
        """Route one turn on `policy` (read_for_turn's; read here when None) by the `live` version (the
        router's settings when None). With a routing seed, a stochastic policy draws from a generator seeded
        by (seed, draw_key) (the turn's user and seq), so the same turn gets the same draws in every run."""
        live = live or self.default_version
        policy_id = self.policy_id(tenant, user_id, live)
        default_arm = self.default_arm if self.default_arm in live.arms else live.arms[0]
        try:
            if policy is None:
                models, version = await self.load(policy_id, live)
            elif policy.corrupt is not None:
                raise PolicyCorrupt(policy.corrupt)
            else:
                models, version = policy.models, policy.version
        except PolicyCorrupt as exc:
            # Never route on broken matrices: the configured default arm answers, and we say so.
            log.error("refusing policy: %s; routing to default arm %s", exc, default_arm)
            return RouteResult(default_arm, [], policy_id, -1, 1.0, None, 0.0, live.version, live.lambda_cost)
        previous = None
        penalties: dict[str, float] = {}
        if self._settings.switch_penalty and session_key:
            previous = await self._previous_arm(session_key)
            if previous:
                penalties = {a: self._settings.switch_penalty for a in live.arms if a != previous}
        rng = turn_rng(self.seed, draw_key) if self.seed is not None and draw_key else None
        decision = live.routing.decide(x, models, penalties, rng)
        return RouteResult(
            decision.arm,
            decision.scores,
            policy_id,
            version,
            decision.propensity,
            previous,
            self._settings.switch_penalty if penalties else 0.0,
            live.version,
            live.lambda_cost,
        )

    async def shadow_decide(
        self, tenant: str, user_id: str, x: np.ndarray, shadow: VersionPolicy, draw_key: str | None = None
    ) -> ShadowResult | None:
        """The shadow version's choice for the turn, on its own matrices and its own draws (keyed apart from
        the live policy's, so the live decision is the same with or without a shadow). None when its
        matrices fail the sanity check: the shadow sits the turn out, the turn is routed as ever."""
        policy_id = self.policy_id(tenant, user_id, shadow)
        read, _ = await shadow.tables.read(policy_id, None)
        if read.corrupt is not None:
            log.error("shadow policy %s refused: %s", policy_id, read.corrupt)
            return None
        rng = turn_rng(self.seed, f"{draw_key}#shadow") if self.seed is not None and draw_key else None
        decision = shadow.routing.decide(x, read.models, None, rng)
        score = next((s.ucb for s in decision.scores if s.arm == decision.arm), 0.0)
        return ShadowResult(
            shadow.version, policy_id, decision.arm, decision.propensity, score, x, shadow.lambda_cost
        )

    async def _previous_arm(self, session_key: str) -> str | None:
        """The arm of the session's last routed turn (for the switch penalty), None before its first."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT arm FROM router_decisions WHERE session_key = %s ORDER BY created_at DESC LIMIT 1",
                (session_key,),
            )
            row = await cur.fetchone()
        return str(row[0]) if row else None

    async def record_decision(
        self,
        turn_id: str,
        policy_id: str,
        arm: str,
        x: np.ndarray,
        session_key: str | None = None,
        tenant: str | None = None,
        route: RouteResult | None = None,
        shadow: ShadowResult | None = None,
        canary_version: str | None = None,
    ) -> None:
        """The turn's decision (with the version that made it and its propensity, from `route`, and the
        canary run it was part of) and the shadow's beside it, in one transaction: once recorded, a
        redelivered view records nothing new."""
        version = route.config_version if route else DEFAULT_VERSION
        async with self._pool.connection() as conn, conn.pipeline(), conn.transaction():
            await conn.execute(
                "INSERT INTO router_decisions (turn_id, policy_id, arm, features, session_key, tenant, "
                "config_version, propensity, lambda_cost, canary_version) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING",
                (
                    turn_id,
                    policy_id,
                    arm,
                    [float(v) for v in x],
                    session_key,
                    tenant,
                    version,
                    route.propensity if route else None,
                    route.lambda_cost if route else None,
                    canary_version,
                ),
            )
            if shadow is not None and tenant is not None:
                await conn.execute(
                    "INSERT INTO router_shadow_decisions (turn_id, tenant, version, policy_id, arm, propensity, "
                    "score, features, lambda_cost) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (
                        turn_id,
                        tenant,
                        shadow.version,
                        shadow.policy_id,
                        shadow.arm,
                        shadow.propensity,
                        shadow.score,
                        [float(v) for v in shadow.x],
                        shadow.lambda_cost,
                    ),
                )

    async def reset(self, policy_id: str) -> None:
        """Back to the cold start (PolicyTables.reset); rewards already applied are never re-applied."""
        await self.tables.reset(policy_id)

    async def apply_reward(
        self,
        turn_id: str,
        answered_arm: str,
        reward: float,
        failed_arms: list[str],
        cost_usd: float = 0.0,
        judge_lambda: float = 0.0,
    ) -> bool:
        """A judged reward, applied once per turn_id (RewardUpdates.apply_reward); False on a repeat."""
        return await self.rewards.apply_reward(
            turn_id, answered_arm, reward, failed_arms, cost_usd, judge_lambda
        )

    async def apply_judged(self, event: ev.Judged) -> tuple[bool, Observed | None]:
        """A judged turn's reward (apply_reward), and its canary run's step (mars_router.rollouts)."""
        return await self.rewards.apply_judged(
            event.turn.turn_id,
            event.arm,
            event.reward,
            list(event.failed_arms),
            event.cost_usd,
            event.lambda_cost,
            event.utility,
        )

    async def apply_correction(self, correction_id: str, turn_id: str, arm: str, delta: float) -> bool:
        """A late feedback correction, once per correction_id (RewardUpdates.apply_correction)."""
        return await self.rewards.apply_correction(correction_id, turn_id, arm, delta)
