"""Judged rewards into a router's arm matrices (mars_router.policy_tables holds the rows): Eq. 11 applied
once per judged turn, late-feedback corrections once per correction id (router_ledger), under optimistic
concurrency between router replicas. With online updates off (MARS_ROUTER_POLICY_UPDATES=false) each is checked
and recorded in the ledger, never applied.

A shadow policy version (mars_router.versions) learns in the same transaction as the live update, from
matched decisions only: when the arm it chose for the turn is an arm whose reward the turn observed (the
answered arm, or a failed one at zero utility), that arm of its matrices takes the reward, with the features
it decided on. No importance weights: under a deterministic live policy (LinUCB, propensity 1) they would be
0 or 1/p with p near 0, and the matched rewards are the shadow's own arm's outcome in that context, so the
update is that of a policy that had played the arm. One ledger row guards both: a redelivered reward updates
neither twice."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import numpy as np
from mars.bus.codec import PoisonEvent
from mars.domain.bandits import RoutingPolicy
from mars.domain.linucb import ArmModel, LinUCBPolicy
from psycopg import AsyncConnection, AsyncCursor, AsyncPipeline
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_tables import dim_of_policy
from mars_router.rollouts import JudgedTurn, Observed, Rollouts
from mars_router.settings import RouterSettings

T = TypeVar("T")

log = logging.getLogger(__name__)

ARM_SQL = "SELECT model, pulls, reward_sum, version FROM router_arms WHERE policy_id = %s AND arm = %s"
SHADOW_SQL = "SELECT policy_id, arm, features, lambda_cost FROM router_shadow_decisions WHERE turn_id = %s"


def version_reward(reward: float, lambda_cost: float | None, judge_lambda: float, cost_usd: float) -> float:
    """The judged reward r = u - lambda_judge * C under a version's own cost weight: u - lambda * C (the
    judge's reward as it is when the version keeps the judge's lambda, None)."""
    if lambda_cost is None:
        return reward
    return reward + (judge_lambda - lambda_cost) * cost_usd


@dataclass(frozen=True)
class Target:
    """One arm row an update changes: the policy's (live or shadow), the arm, its reward, its context."""

    policy_id: str
    arm: str
    reward: float
    x: np.ndarray
    #: A shadow version's row: a problem with it (missing, failing its sanity check) skips the shadow's
    #: update and never holds up the live one.
    shadow: bool = False

    def shifted(self, model: ArmModel) -> ArmModel:
        """`model` with an applied reward moved by this target's reward (a correction's delta)."""
        return model.shifted(self.x, self.reward)


class Decided(NamedTuple):
    """A routed turn's decision row, as a reward needs it."""

    policy_id: str
    arm: str
    x: np.ndarray
    #: Its version's cost weight (None: the judge's).
    lambda_cost: float | None
    tenant: str
    config_version: str
    #: The canary run the turn was part of (mars_router.rollouts), None without one.
    canary_version: str | None


class StaleArm(Exception):
    """An arm row changed between our read and our conditional write (optimistic concurrency)."""


class RewardUpdates:
    def __init__(
        self,
        pool: AsyncConnectionPool,
        settings: RouterSettings,
        arms: list[str],
        dim: int,
        routing: RoutingPolicy,
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._arms = arms
        self._dim = dim
        #: Its `update` is Eq. 11 (every routing policy keeps ridge-regression arms); the same step over
        #: another feature dimension (a policy version's) by `_updaters`.
        self._routing = routing
        self._updaters: dict[int, LinUCBPolicy] = {}
        #: False: a frozen policy (MARS_ROUTER_POLICY_UPDATES=false); rewards are recorded, never applied.
        self.updates = settings.policy_updates
        #: Optimistic update conflicts retried (a replica wrote an arm between our read and write).
        self.update_conflicts = 0
        #: The tenants' canary runs: each judged turn of one is added to its test in the reward's transaction.
        self.rollouts = Rollouts(pool, settings.rollout_config())

    async def apply_reward(
        self,
        turn_id: str,
        answered_arm: str,
        reward: float,
        failed_arms: list[str],
        cost_usd: float = 0.0,
        judge_lambda: float = 0.0,
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

        A version with its own cost weight learns u - lambda * C (`version_reward`, from the turn's
        `cost_usd` and the judge's `judge_lambda`); the ledger keeps the live policy's reward. A shadow
        decision of the turn learns too when matched (module docstring), in the same transaction.
        """
        done = await self.apply_judged(turn_id, answered_arm, reward, failed_arms, cost_usd, judge_lambda)
        return done[0]

    async def apply_judged(
        self,
        turn_id: str,
        answered_arm: str,
        reward: float,
        failed_arms: list[str],
        cost_usd: float = 0.0,
        judge_lambda: float = 0.0,
        utility: float | None = None,
    ) -> tuple[bool, Observed | None]:
        """`apply_reward`, and the turn's canary run (if it was part of one) takes it in the same
        transaction (mars_router.rollouts): what the run saw, and whether this turn decided it."""
        return await self._optimistic(
            turn_id,
            lambda: self._apply_reward_once(
                turn_id, answered_arm, reward, failed_arms, (cost_usd, judge_lambda, utility)
            ),
        )

    async def apply_correction(self, correction_id: str, turn_id: str, arm: str, delta: float) -> bool:
        """Move an applied reward by `delta` (late user feedback): b += delta * x for the answered arm,
        A and the pull count unchanged; once per correction_id. False when already applied. With online
        updates off, or for a turn whose reward was recorded while they were off, it is only recorded."""
        return await self._optimistic(
            turn_id, lambda: self._apply_correction_once(correction_id, turn_id, arm, delta)
        )

    async def _optimistic(self, turn_id: str, attempt_once: Callable[[], Awaitable[T]]) -> T:
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

    async def _decision(self, conn: AsyncConnection, turn_id: str, arms: Sequence[str]) -> Decided:
        """A routed turn's decision, after the checks every reward must pass."""
        cur = await conn.execute(
            "SELECT policy_id, arm, features, lambda_cost, tenant, config_version, canary_version "
            "FROM router_decisions WHERE turn_id = %s",
            (turn_id,),
        )
        decision = await cur.fetchone()
        if decision is None:
            raise PoisonEvent(f"judged turn {turn_id} has no routing decision")
        policy_id, chosen, features, lambda_cost, tenant, config_version, canary = decision
        dim = self._dim_of(str(policy_id))
        if len(features) != dim:
            raise PoisonEvent(f"turn {turn_id} has {len(features)} features, its policy uses {dim}")
        for name in arms:
            if name and name not in self._arms:
                raise PoisonEvent(f"turn {turn_id} names arm {name!r}, which is not in the pool")
        lam = None if lambda_cost is None else float(lambda_cost)
        x = np.asarray(features, dtype=np.float64)
        return Decided(
            str(policy_id), str(chosen), x, lam, str(tenant or ""), str(config_version or ""), canary
        )

    def _dim_of(self, policy_id: str) -> int:
        """The feature dimension of a policy by its id (this router's, or a version's other feature set)."""
        return dim_of_policy(policy_id, self._dim)

    def _update(self, model: ArmModel, x: np.ndarray, reward: float) -> ArmModel:
        """Eq. 11 for one arm, over x's own dimension."""
        if len(x) == self._dim:
            return self._routing.update(model, x, reward)
        updater = self._updaters.get(len(x))
        if updater is None:
            updater = self._updaters[len(x)] = LinUCBPolicy(self._arms, len(x), alpha=0.0)
        return updater.update(model, x, reward)

    @staticmethod
    def _shadow_target(row: Sequence[Any] | None, observed: dict[str, float]) -> Target | None:
        """The shadow's update for the turn when matched (its arm's reward was observed), else None."""
        if row is None or str(row[1]) not in observed:
            return None
        return Target(
            str(row[0]), str(row[1]), observed[str(row[1])], np.asarray(row[2], dtype=np.float64), shadow=True
        )

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
            policy_id, _, x, *_ = await self._decision(conn, turn_id, [arm])
            # A correction moves an applied reward: one recorded while the policy was frozen was never
            # applied, so its corrections are recorded only, even once updates are on again.
            cur = await conn.execute("SELECT applied FROM router_ledger WHERE turn_id = %s", (turn_id,))
            reward_row = await cur.fetchone()
            apply = self.updates and (reward_row is None or bool(reward_row[0]))
            ledger = await self._ledger(conn, correction_id, policy_id, arm, delta, apply)
            if await ledger.fetchone() is None:
                return False
            if not apply:
                return True
            cur = await conn.execute(SHADOW_SQL, (turn_id,))
            targets = [Target(policy_id, arm, delta, x)]
            # A matched shadow took the reward with the live policy: it takes the correction with it.
            if (shadow := self._shadow_target(await cur.fetchone(), {arm: delta})) is not None:
                targets.append(shadow)
            for t in sorted(targets, key=lambda t: (t.policy_id, t.arm)):
                try:
                    await self._write_arm(conn, t.policy_id, t.arm, t.shifted)
                except PoisonEvent as exc:
                    if not t.shadow:
                        raise
                    log.error("correction %s: shadow update skipped: %s", correction_id, exc)
        return True

    async def _apply_reward_once(
        self,
        turn_id: str,
        answered_arm: str,
        reward: float,
        failed_arms: list[str],
        judged: tuple[float, float, float | None],
    ) -> tuple[bool, Observed | None]:
        cost_usd, judge_lambda, utility = judged
        if not math.isfinite(reward) or not self._settings.min_reward <= reward <= self._settings.max_reward:
            raise PoisonEvent(
                f"reward {reward} for turn {turn_id} is outside "
                f"[{self._settings.min_reward}, {self._settings.max_reward}]"
            )
        # Four round trips, pipelined: the decision and the shadow's; the ledger row with the arms' reads;
        # the arms' writes; the commit (and, for a turn of a canary run, the run's row before the writes).
        async with self._pool.connection() as conn, conn.pipeline() as pipeline, conn.transaction():
            shadow_cur = await conn.execute(SHADOW_SQL, (turn_id,))
            d = await self._decision(conn, turn_id, [answered_arm, *failed_arms])
            shadow_row = await shadow_cur.fetchone()
            if d.canary_version and d.tenant:
                await self.rollouts.lock(conn, d.tenant)  # before the arms are read (module docstring)
            arm = answered_arm or d.arm
            ledger = await self._ledger(conn, turn_id, d.policy_id, arm, reward, self.updates)
            failed = [a for a in dict.fromkeys(failed_arms) if a != arm]
            targets: list[Target] = []
            if self.updates:
                own = version_reward(reward, d.lambda_cost, judge_lambda, cost_usd)
                targets = [Target(d.policy_id, arm, own, d.x)]
                targets += [Target(d.policy_id, a, 0.0, d.x) for a in failed]
                shadow_lam = None if shadow_row is None or shadow_row[3] is None else float(shadow_row[3])
                observed = {arm: version_reward(reward, shadow_lam, judge_lambda, cost_usd)} | dict.fromkeys(
                    failed, 0.0
                )
                if (shadow := self._shadow_target(shadow_row, observed)) is not None:
                    targets.append(shadow)
            # Written in one global order: a writer waiting on a row another replica is committing
            # cannot wait in a cycle (live and shadow rows alike: a promotion swaps which is which).
            targets.sort(key=lambda t: (t.policy_id, t.arm))
            reads = [await conn.execute(ARM_SQL, (t.policy_id, t.arm)) for t in targets]
            if await ledger.fetchone() is None:
                return False, None
            run = None
            if d.canary_version and d.tenant:
                # Failed: the arm its version chose failed (a fallback answered); a turn no arm answered
                # is never judged.
                chosen_failed = d.arm in failed_arms
                turn = JudgedTurn(
                    d.tenant,
                    d.canary_version,
                    d.config_version,
                    arm,
                    reward,
                    cost_usd,
                    chosen_failed,
                    utility,
                )
                run = await self.rollouts.observe(conn, turn)
            await self._write_targets(conn, pipeline, turn_id, targets, reads)
        return True, run

    async def _write_targets(
        self,
        conn: AsyncConnection,
        pipeline: AsyncPipeline,
        turn_id: str,
        targets: list[Target],
        reads: list[AsyncCursor[Any]],
    ) -> None:
        """Eq. 11 on each target read, written back only if unchanged since (StaleArm otherwise)."""
        writes = []
        for t, read in zip(targets, reads, strict=True):
            try:
                model, version = self._arm_model(t.policy_id, t.arm, await read.fetchone())
            except PoisonEvent as exc:
                if not t.shadow:
                    raise
                log.error("turn %s: shadow update skipped: %s", turn_id, exc)
                continue
            updated = self._update(model, t.x, t.reward)
            writes.append((t, await self._conditional_write(conn, t.policy_id, t.arm, updated, version)))
        await pipeline.sync()
        for t, write in writes:
            if write.rowcount != 1:
                raise StaleArm(f"policy {t.policy_id}, arm {t.arm} changed since it was read")

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
        model = ArmModel.from_bytes(bytes(row[0]), self._dim_of(policy_id), int(row[1]), float(row[2]))
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
