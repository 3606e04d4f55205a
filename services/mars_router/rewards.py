"""Judged rewards into a router's arm matrices (mars_router.policy_tables holds the rows): Eq. 11 applied
once per judged turn, late-feedback corrections once per correction id (router_ledger), under optimistic
concurrency between router replicas. With online updates off (MARS_ROUTER_POLICY_UPDATES=false) each is checked
and recorded in the ledger, never applied."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from mars.bus.codec import PoisonEvent
from mars.domain.bandits import RoutingPolicy
from mars.domain.linucb import ArmModel
from psycopg import AsyncConnection, AsyncCursor
from psycopg_pool import AsyncConnectionPool

from mars_router.settings import RouterSettings

ARM_SQL = "SELECT model, pulls, reward_sum, version FROM router_arms WHERE policy_id = %s AND arm = %s"


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
        #: Its `update` is Eq. 11 (every routing policy keeps ridge-regression arms).
        self._routing = routing
        #: False: a frozen policy (MARS_ROUTER_POLICY_UPDATES=false); rewards are recorded, never applied.
        self.updates = settings.policy_updates
        #: Optimistic update conflicts retried (a replica wrote an arm between our read and write).
        self.update_conflicts = 0

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
        if len(features) != self._dim:
            raise PoisonEvent(f"turn {turn_id} has {len(features)} features, this router uses {self._dim}")
        for name in arms:
            if name and name not in self._arms:
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
            ledger = await self._ledger(conn, correction_id, policy_id, arm, delta, apply)
            if await ledger.fetchone() is None:
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
                updated = self._routing.update(model, x, r)
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
        model = ArmModel.from_bytes(bytes(row[0]), self._dim, int(row[1]), float(row[2]))
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
