"""Router persistence: policy matrices, routing decisions and the applied-update ledger in Postgres.

`PolicyStore` loads a policy's arm models, asks the routing policy (mars.domain.bandits) for a decision,
records it, and applies each judged reward exactly once under optimistic concurrency. The service module
is the transport around it (Kafka stages and the gRPC servicer)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mars.bus.codec import PoisonEvent
from mars.domain.bandits import make_routing_policy, turn_rng, uses_query_features
from mars.domain.features import (
    FEATURE_DIM,
    QUERY_FEATURE_DIM,
    RECENT_TURNS,
    featurize,
    phase_of,
    query_features,
)
from mars.domain.linucb import ArmModel
from mars.v1 import events_pb2 as ev
from psycopg import AsyncConnection, AsyncCursor
from psycopg_pool import AsyncConnectionPool

from mars_router.settings import RouterSettings

log = logging.getLogger(__name__)


def policy_id_for(scope: str, tenant: str, user_id: str, feature_space: str = "state") -> str:
    """Policy ids by scope; a policy over another feature space (query embeddings) gets its own id, so
    switching the routing policy never loads matrices of the wrong dimension."""
    if scope == "global":
        base = "global"
    elif scope == "tenant":
        base = f"tenant:{tenant}"
    else:
        base = f"user:{tenant}/{user_id}"
    return base if feature_space == "state" else f"{base}#{feature_space}"


class PolicyCorrupt(Exception):
    """A stored policy's matrices failed the sanity check (non-finite, A not positive definite)."""


@dataclass(frozen=True)
class RouteResult:
    arm: str
    scores: list[ev.ArmScore]
    policy_id: str
    version: int
    propensity: float
    previous_arm: str | None = None
    switch_penalty: float = 0.0


@dataclass(frozen=True)
class PolicyRead:
    """A policy as read for one turn: its arm models and version, or why it is refused."""

    models: dict[str, ArmModel]
    version: int
    #: Set when the stored matrices failed the sanity check: the turn goes to the default arm.
    corrupt: str | None = None


ARM_SQL = "SELECT model, pulls, reward_sum, version FROM router_arms WHERE policy_id = %s AND arm = %s"
PHASES_SQL = (
    "SELECT features FROM router_decisions WHERE session_key = %s AND turn_id <> %s "
    "ORDER BY created_at DESC LIMIT %s"
)


class StaleArm(Exception):
    """An arm row changed between our read and our conditional write (optimistic concurrency)."""


class PolicyStore:
    def __init__(self, pool: AsyncConnectionPool, settings: RouterSettings, arms: list[str]) -> None:
        self._pool = pool
        #: Policies this process has created or found (with every arm's row): not written again per turn.
        self._ensured: set[str] = set()
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
        #: MARS_ROUTING_SEED: per-turn seeded draws (None: OS entropy).
        self.seed = settings.routing_seed
        #: Optimistic update conflicts retried (a replica wrote an arm between our read and write).
        self.update_conflicts = 0
        self.default_arm = settings.default_arm or arms[0]
        #: False: a frozen policy (MARS_POLICY_UPDATES=false); rewards are recorded, never applied.
        self.updates = settings.policy_updates
        if self.default_arm not in arms:
            raise ValueError(f"default_arm {self.default_arm!r} is not in the model pool {arms}")

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
                    "query-linucb got a view without a query embedding (set MARS_VIEW_QUERY_EMBEDDING=true "
                    "on the memory service); routing on the bias term alone"
                )
            return query_features(list(query_embedding))
        return featurize(state, load, depth, recent_phases)

    async def read_for_turn(
        self, tenant: str, user_id: str, session_key: str, turn_id: str
    ) -> tuple[list[int], PolicyRead]:
        """For routing a turn, in one round trip: the phases of the session's last routed turns before it,
        oldest first (Table 7's recent revision / finalization flags, read back from the state features
        logged with each decision; none for a query-feature policy), and the user's policy."""
        policy_id = policy_id_for(self._settings.policy_scope, tenant, user_id, self.feature_space)
        read, rows = await self._read(policy_id, (session_key, turn_id))
        return [phase_of(list(row[0])) for row in reversed(rows)], read

    async def _ensure(self, conn: AsyncConnection, policy_id: str) -> None:
        cur = await conn.execute(
            "INSERT INTO router_policies (policy_id, scope, dim, alpha, ridge) VALUES (%s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING RETURNING policy_id",
            (policy_id, self._settings.policy_scope, self.dim, self._settings.alpha, self._settings.ridge),
        )
        created = await cur.fetchone() is not None
        cold = ArmModel.cold(self.dim, self._settings.ridge).to_bytes()
        seed: dict[str, bytes] = {}
        if created and self._settings.warm_start_from_tenant and policy_id.startswith("user:"):
            # A new user's policy starts from its tenant's matrices (pull counts start at zero).
            tenant = policy_id[len("user:") :].split("/", 1)[0]
            cur = await conn.execute(
                "SELECT arm, model FROM router_arms WHERE policy_id = %s",
                (policy_id_for("tenant", tenant, "", self.feature_space),),
            )
            seed = {str(arm): bytes(blob) for arm, blob in await cur.fetchall()}
        for arm in self.arms:
            await conn.execute(
                "INSERT INTO router_arms (policy_id, arm, model) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (policy_id, arm, seed.get(arm, cold)),
            )

    async def load(self, policy_id: str) -> tuple[dict[str, ArmModel], int]:
        """The policy's arm models and its version: resets plus arm updates, so it grows with every
        applied reward without a policy-wide row that every update would have to lock. PolicyCorrupt when
        its matrices fail the sanity check."""
        read, _ = await self._read(policy_id, None)
        if read.corrupt is not None:
            raise PolicyCorrupt(read.corrupt)
        return read.models, read.version

    async def _read(
        self, policy_id: str, phases_of: tuple[str, str] | None
    ) -> tuple[PolicyRead, list[tuple[Any, ...]]]:
        """The policy (created when new) and, for (session_key, turn_id), the session's recent decision
        rows, pipelined in one round trip."""
        async with self._pool.connection() as conn:
            if policy_id not in self._ensured:
                await self._ensure(conn, policy_id)
            async with conn.pipeline() as pipeline:
                phases_cur = None
                if phases_of is not None and self.feature_space == "state":
                    phases_cur = await conn.execute(PHASES_SQL, (*phases_of, RECENT_TURNS))
                version_cur = await conn.execute(
                    "SELECT version FROM router_policies WHERE policy_id = %s", (policy_id,)
                )
                arms_cur = await conn.execute(
                    "SELECT arm, model, pulls, reward_sum, version FROM router_arms WHERE policy_id = %s",
                    (policy_id,),
                )
                await pipeline.sync()
                phase_rows = await phases_cur.fetchall() if phases_cur is not None else []
                row = await version_cur.fetchone()
                rows = await arms_cur.fetchall()
        if row is None and policy_id in self._ensured:
            # Removed since this process created it: create it again.
            self._ensured.discard(policy_id)
            return await self._read(policy_id, phases_of)
        if len(self._ensured) > 100_000:
            self._ensured.clear()
        self._ensured.add(policy_id)
        version = int(row[0]) if row else 0
        models = {
            arm: ArmModel.from_bytes(bytes(blob), self.dim, int(pulls), float(reward_sum))
            for arm, blob, pulls, reward_sum, _ in rows
        }
        version += sum(int(r[4]) for r in rows)
        corrupt = next(
            (
                f"policy {policy_id}, arm {arm}: {why}"
                for arm, model in models.items()
                if (why := model.sanity_error()) is not None
            ),
            None,
        )
        return PolicyRead({a: models[a] for a in self.arms if a in models}, version, corrupt), phase_rows

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
        policy_id = policy_id_for(self._settings.policy_scope, tenant, user_id, self.feature_space)
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
            async with self._pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT arm FROM router_decisions WHERE session_key = %s ORDER BY created_at DESC LIMIT 1",
                    (session_key,),
                )
                row = await cur.fetchone()
            previous = str(row[0]) if row else None
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

    async def reset(self, policy_id: str) -> None:
        """Back to the cold start; the ledger stays, so rewards already applied are never re-applied."""
        cold = ArmModel.cold(self.dim, self._settings.ridge).to_bytes()
        async with self._pool.connection() as conn, conn.transaction():
            await self._ensure(conn, policy_id)
            await conn.execute(
                "UPDATE router_arms SET model = %s, pulls = 0, reward_sum = 0, version = version + 1 "
                "WHERE policy_id = %s",
                (cold, policy_id),
            )
            await conn.execute(
                "UPDATE router_policies SET version = version + 1 WHERE policy_id = %s", (policy_id,)
            )

    async def record_decision(
        self, turn_id: str, policy_id: str, arm: str, x: np.ndarray, session_key: str | None = None
    ) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO router_decisions (turn_id, policy_id, arm, features, session_key) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (turn_id, policy_id, arm, [float(v) for v in x], session_key),
            )

    async def apply_reward(
        self, turn_id: str, answered_arm: str, reward: float, failed_arms: list[str]
    ) -> bool:
        """Apply Eq. 11 once per turn_id; False when this turn was already applied (or recorded).

        The reward updates the arm that answered (usually the chosen one); an arm whose call failed
        earlier in the fallback chain is updated with zero utility for the same context, so the router
        learns to stop choosing a broken endpoint.

        Concurrency is optimistic: arm rows are read without locks and written only if their version is
        unchanged; when another replica got there first the whole transaction (ledger row included) rolls
        back and is retried on fresh matrices, so no update is lost and none is applied twice.

        With online updates off the reward passes the same checks and is recorded in the ledger
        (applied = false), and no arm changes.
        """
        return await self._optimistic(
            turn_id, lambda: self._apply_reward_once(turn_id, answered_arm, reward, failed_arms)
        )

    async def apply_correction(self, correction_id: str, turn_id: str, arm: str, delta: float) -> bool:
        """Move an applied reward by `delta` (late user feedback): b += delta * x for the answered arm,
        A and the pull count unchanged; once per correction_id. False when already applied. With online
        updates off, or for a turn whose reward was recorded while they were off, it is only recorded."""
        return await self._optimistic(
            turn_id, lambda: self._apply_correction_once(correction_id, turn_id, arm, delta)
        )

    async def _optimistic(self, turn_id: str, attempt_once: Callable[[], Awaitable[bool]]) -> bool:
        for attempt in range(self._settings.update_attempts):
            try:
                return await attempt_once()
            except StaleArm:
                self.update_conflicts += 1
                # Jittered backoff: replicas that collided should not collide again in lockstep.
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        raise RuntimeError(
            f"reward for turn {turn_id}: {self._settings.update_attempts} optimistic update conflicts in a row"
        )

    async def _decision(
        self, conn: AsyncConnection, turn_id: str, arms: Sequence[str]
    ) -> tuple[str, str, np.ndarray]:
        """(policy_id, chosen arm, x) of a routed turn, after the checks every reward must pass."""
        cur = await conn.execute(
            "SELECT policy_id, arm, features FROM router_decisions WHERE turn_id = %s", (turn_id,)
        )
        decision = await cur.fetchone()
        if decision is None:
            raise PoisonEvent(f"judged turn {turn_id} has no routing decision")
        policy_id, chosen, features = decision
        if len(features) != self.dim:
            raise PoisonEvent(f"turn {turn_id} has {len(features)} features, this router uses {self.dim}")
        for name in arms:
            if name and name not in self.arms:
                raise PoisonEvent(f"turn {turn_id} names arm {name!r}, which is not in the pool")
        return str(policy_id), str(chosen), np.asarray(features, dtype=np.float64)

    async def _ledger(
        self, conn: AsyncConnection, key: str, policy_id: str, arm: str, reward: float, applied: bool
    ) -> AsyncCursor[Any]:
        """Record an update once: the cursor's row is None when `key` was already recorded (at-least-once
        delivery). Not fetched here, so a pipeline can send more with it. `applied` false (online updates
        off): recorded only, the caller changes no arm."""
        return await conn.execute(
            "INSERT INTO router_ledger (turn_id, policy_id, arm, reward, applied) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING turn_id",
            (key, policy_id, arm, reward, applied),
        )

    async def _apply_correction_once(self, correction_id: str, turn_id: str, arm: str, delta: float) -> bool:
        if not math.isfinite(delta) or abs(delta) > self._settings.max_reward - self._settings.min_reward:
            raise PoisonEvent(f"correction {correction_id}: reward delta {delta} is out of range")
        async with self._pool.connection() as conn, conn.transaction():
            policy_id, _, x = await self._decision(conn, turn_id, [arm])
            # A correction moves an applied reward: one recorded while the policy was frozen was never
            # applied, so its corrections are recorded only, even once updates are on again.
            cur = await conn.execute("SELECT applied FROM router_ledger WHERE turn_id = %s", (turn_id,))
            reward_row = await cur.fetchone()
            apply = self.updates and (reward_row is None or bool(reward_row[0]))
            if await (await self._ledger(conn, correction_id, policy_id, arm, delta, apply)).fetchone() is None:
                return False
            if not apply:
                return True
            await self._write_arm(conn, policy_id, arm, lambda m: m.shifted(x, delta))
        return True

    async def _apply_reward_once(
        self, turn_id: str, answered_arm: str, reward: float, failed_arms: list[str]
    ) -> bool:
        if not math.isfinite(reward) or not self._settings.min_reward <= reward <= self._settings.max_reward:
            raise PoisonEvent(
                f"reward {reward} for turn {turn_id} is outside "
                f"[{self._settings.min_reward}, {self._settings.max_reward}]"
            )
        # Four round trips, pipelined: the decision; the ledger row with the arms' reads; the arms' writes;
        # the commit.
        async with self._pool.connection() as conn, conn.pipeline() as pipeline, conn.transaction():
            policy_id, chosen, x = await self._decision(conn, turn_id, [answered_arm, *failed_arms])
            arm = answered_arm or chosen
            ledger = await self._ledger(conn, turn_id, policy_id, arm, reward, self.updates)
            targets = [(arm, reward), *((a, 0.0) for a in dict.fromkeys(failed_arms) if a != arm)]
            # Written in one global order: a writer waiting on a row another replica is committing
            # cannot wait in a cycle.
            targets = sorted(targets) if self.updates else []
            reads = [await conn.execute(ARM_SQL, (policy_id, target)) for target, _ in targets]
            if await ledger.fetchone() is None:
                return False
            writes = []
            for (target, r), read in zip(targets, reads, strict=True):
                model, version = self._arm_model(policy_id, target, await read.fetchone())
                updated = self.routing.update(model, x, r)
                write = await self._conditional_write(conn, policy_id, target, updated, version)
                writes.append((target, write))
            await pipeline.sync()
            for target, write in writes:
                if write.rowcount != 1:
                    raise StaleArm(f"policy {policy_id}, arm {target} changed since it was read")
        return True

    async def _write_arm(
        self, conn: AsyncConnection, policy_id: str, arm: str, change: Callable[[ArmModel], ArmModel]
    ) -> None:
        """Read an arm, apply `change`, write it back only if nobody wrote it meanwhile (else StaleArm)."""
        cur = await conn.execute(ARM_SQL, (policy_id, arm))
        model, version = self._arm_model(policy_id, arm, await cur.fetchone())
        cur = await self._conditional_write(conn, policy_id, arm, change(model), version)
        if cur.rowcount != 1:
            raise StaleArm(f"policy {policy_id}, arm {arm} changed since it was read")

    def _arm_model(self, policy_id: str, arm: str, row: tuple[Any, ...] | None) -> tuple[ArmModel, int]:
        """The arm of an ARM_SQL row and its row version (PoisonEvent when it is missing or fails its
        sanity check: no update is applied to broken matrices)."""
        if row is None:
            raise PoisonEvent(f"policy {policy_id} has no arm {arm}")
        model = ArmModel.from_bytes(bytes(row[0]), self.dim, int(row[1]), float(row[2]))
        if (why := model.sanity_error()) is not None:
            raise PoisonEvent(
                f"policy {policy_id}, arm {arm} failed its sanity check ({why}); update refused"
            )
        return model, int(row[3])

    async def _conditional_write(
        self, conn: AsyncConnection, policy_id: str, arm: str, updated: ArmModel, version: int
    ) -> AsyncCursor[Any]:
        """Write `updated` if the row is still at `version`; the cursor's rowcount says (1: written)."""
        return await conn.execute(
            "UPDATE router_arms SET model = %s, pulls = %s, reward_sum = %s, version = version + 1 "
            "WHERE policy_id = %s AND arm = %s AND version = %s",
            (updated.to_bytes(), updated.pulls, updated.reward_sum, policy_id, arm, version),
        )
