"""Router policies: the routing side of a router's policies in Postgres, over the tables
(mars_router.policy_tables) and the reward updates (mars_router.rewards).

`PolicyStore` builds a turn's context vector, reads the policy it routes on, asks the routing policy
(mars.domain.bandits) for a decision, records it, and hands each judged reward to `RewardUpdates`. The
service module is the transport around it (Kafka stages and the gRPC servicer)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mars.domain.bandits import make_routing_policy, turn_rng, uses_query_features
from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM, featurize, phase_of, query_features
from mars.domain.linucb import ArmModel
from mars.v1 import events_pb2 as ev
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_tables import PolicyCorrupt, PolicyRead, PolicyTables, policy_id_for
from mars_router.rewards import RewardUpdates
from mars_router.settings import RouterSettings

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
    ) -> np.ndarray:
        """The policy's context vector: the state feature map, or the projected query embedding."""
        if self.feature_space == "query":
            if not query_embedding and not self._warned_no_embedding:
                self._warned_no_embedding = True
                log.warning(
                    "query-linucb got a view without a query embedding (set MARS_MEMORY_VIEW_QUERY_EMBEDDING=true "
                    "on the memory service); routing on the bias term alone"
                )
            return query_features(list(query_embedding))
        return featurize(state, load, depth, recent_phases)

    def policy_id(self, tenant: str, user_id: str) -> str:
        """The id of the policy that routes the user's turns (by MARS_ROUTER_POLICY_SCOPE and feature space)."""
        return policy_id_for(self._settings.policy_scope, tenant, user_id, self.feature_space)

    async def read_for_turn(
        self, tenant: str, user_id: str, session_key: str, turn_id: str
    ) -> tuple[list[int], PolicyRead]:
        """For routing a turn, in one round trip: the phases of the session's last routed turns before it,
        oldest first (Table 7's recent revision / finalization flags, read back from the state features
        logged with each decision; none for a query-feature policy), and the user's policy."""
        read, rows = await self.tables.read(self.policy_id(tenant, user_id), (session_key, turn_id))
        return [phase_of(list(row[0])) for row in reversed(rows)], read

    async def load(self, policy_id: str) -> tuple[dict[str, ArmModel], int]:
        """The policy's arm models and its version (created when new); PolicyCorrupt when its matrices
        fail the sanity check."""
        read, _ = await self.tables.read(policy_id, None)
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
    ) -> RouteResult:
        """Route one turn on `policy` (read_for_turn's; read here when None). With a routing seed, a
        stochastic policy draws from a generator seeded by (seed, draw_key) (the turn's user and seq), so
        the same turn gets the same draws in every run."""
        policy_id = self.policy_id(tenant, user_id)
        try:
            if policy is None:
                models, version = await self.load(policy_id)
            elif policy.corrupt is not None:
                raise PolicyCorrupt(policy.corrupt)
            else:
                models, version = policy.models, policy.version
        except PolicyCorrupt as exc:
            # Never route on broken matrices: the configured default arm answers, and we say so.
            log.error("refusing policy: %s; routing to default arm %s", exc, self.default_arm)
            return RouteResult(self.default_arm, [], policy_id, -1, 1.0)
        previous = None
        penalties: dict[str, float] = {}
        if self._settings.switch_penalty and session_key:
            previous = await self._previous_arm(session_key)
            if previous:
                penalties = {a: self._settings.switch_penalty for a in self.arms if a != previous}
        rng = turn_rng(self.seed, draw_key) if self.seed is not None and draw_key else None
        decision = self.routing.decide(x, models, penalties, rng)
        return RouteResult(
            decision.arm,
            decision.scores,
            policy_id,
            version,
            decision.propensity,
            previous,
            self._settings.switch_penalty if penalties else 0.0,
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
        self, turn_id: str, policy_id: str, arm: str, x: np.ndarray, session_key: str | None = None
    ) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO router_decisions (turn_id, policy_id, arm, features, session_key) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (turn_id, policy_id, arm, [float(v) for v in x], session_key),
            )

    async def reset(self, policy_id: str) -> None:
        """Back to the cold start (PolicyTables.reset); rewards already applied are never re-applied."""
        await self.tables.reset(policy_id)

    async def apply_reward(
        self, turn_id: str, answered_arm: str, reward: float, failed_arms: list[str]
    ) -> bool:
        """A judged reward, applied once per turn_id (RewardUpdates.apply_reward); False on a repeat."""
        return await self.rewards.apply_reward(turn_id, answered_arm, reward, failed_arms)

    async def apply_correction(self, correction_id: str, turn_id: str, arm: str, delta: float) -> bool:
        """A late feedback correction, once per correction_id (RewardUpdates.apply_correction)."""
        return await self.rewards.apply_correction(correction_id, turn_id, arm, delta)
