"""Canary runs on the router (issue 47; the test is mars.domain.rollout): each judged turn of a tenant with
an open run (router_rollouts, started by `mars policy canary`) is added to the run's test in the reward's
own transaction, so a redelivered Judged (a ledger duplicate) adds nothing: every judged turn counts once.
A turn counts for the side that decided it (its router_decisions row: config_version is the candidate's,
or the run's live version's; a turn decided before the run, or by a version since replaced, is left out).

After the turn, `decide`: on PROMOTE the candidate becomes live, on ROLLBACK (the test or a guardrail) or
UNDECIDED (the turn cap) the canary role is dropped, in the same transaction, with an audit row carrying the
evidence (mars_router.policy_admin.decide_canary), and the run is marked decided. The transaction holds the
tenant's policy lock (policy_admin.LOCK_SQL) from before it reads the arms: an operator's change of the
tenant's roles and the tenant's judged turns under a run are serialised, and never wait on each other in a
cycle (both take the lock first; a correction takes no lock and no run row).

The service then publishes the decision (a PolicyDecision on mars.control) and marks the run published; a
decision whose publication failed stays in the row (decided, not published) and is published again at the
router's next start (`unpublished`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from mars.domain.rollout import Decision, Evidence, RolloutConfig, RolloutState, decide
from mars.v1 import events_pb2 as ev
from psycopg import AsyncConnection
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_admin import LOCK_SQL, decide_canary

OPEN_RUN_SQL = (
    "SELECT rollout_id, live_version, state FROM router_rollouts "
    "WHERE tenant = %s AND candidate_version = %s AND decided_at IS NULL FOR UPDATE"
)
UPDATE_RUN_SQL = (
    "UPDATE router_rollouts SET state = %s, config = %s, turns = turns + 1, evidence = %s, decision = %s, "
    "rule = %s, decided_at = CASE WHEN %s THEN now() END, updated_at = now() WHERE rollout_id = %s "
    "RETURNING turns, decided_at"
)
UNPUBLISHED_SQL = (
    "SELECT rollout_id, tenant, live_version, candidate_version, turns, evidence, decided_at "
    "FROM router_rollouts WHERE decided_at IS NOT NULL AND published_at IS NULL "
    "AND decision IN ('promote', 'rollback', 'undecided') ORDER BY rollout_id"
)


def finite(value: Any) -> Any:
    """JSON-safe evidence: a CS end that is still infinite (too few turns) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Observed:
    """A judged turn a canary run took in, and where the run stands after it."""

    rollout_id: int
    tenant: str
    live_version: str
    candidate_version: str
    #: "canary" or "live": the side that decided the turn.
    role: str
    arm: str
    reward: float
    cost_usd: float
    evidence: Evidence
    turns: int
    #: This turn's run decided (promote, rollback, undecided): the caller publishes the decision.
    decided_at: datetime | None

    def event(self) -> ev.PolicyDecision:
        return decision_event(
            self.rollout_id,
            self.tenant,
            self.live_version,
            self.candidate_version,
            self.evidence.to_dict(),
            self.decided_at,
        )


def decision_event(
    rollout_id: int,
    tenant: str,
    live: str,
    candidate: str,
    evidence: dict[str, Any],
    decided_at: datetime | None,
) -> ev.PolicyDecision:
    """The PolicyDecision of a decided run, from its row's evidence."""
    return ev.PolicyDecision(
        tenant=tenant,
        live_version=live,
        candidate_version=candidate,
        decision=str(evidence["decision"]),
        rule=str(evidence["reason"]),
        turns_live=int(evidence["turns_live"]),
        turns_candidate=int(evidence["turns_candidate"]),
        statistic=float(evidence["statistic"] or 0.0),
        boundary=float(evidence["boundary"] or 0.0),
        evidence_json=json.dumps(finite(evidence), sort_keys=True),
        decided_at_ms=int(decided_at.timestamp() * 1000) if decided_at else 0,
        rollout_id=rollout_id,
    )


@dataclass(frozen=True)
class JudgedTurn:
    """What a canary run takes from a judged turn: its decision's side and the judge's numbers."""

    tenant: str
    candidate: str
    config_version: str
    arm: str
    reward: float
    cost_usd: float
    failed: bool
    utility: float | None


class Rollouts:
    """The router's canary runs (router_rollouts), with the test configured by MARS_ROUTER_ROLLOUT_*."""

    def __init__(self, pool: AsyncConnectionPool, config: RolloutConfig) -> None:
        self._pool = pool
        self.config = config

    @staticmethod
    async def lock(conn: AsyncConnection, tenant: str) -> None:
        """The tenant's policy lock, for the rest of the transaction (taken before the arms are read)."""
        await conn.execute(LOCK_SQL, (tenant,))

    async def observe(self, conn: AsyncConnection, turn: JudgedTurn) -> Observed | None:
        """Add the turn to its tenant's open run and decide, in the caller's transaction (which holds the
        tenant's lock); None when the turn belongs to no open run."""
        cur = await conn.execute(OPEN_RUN_SQL, (turn.tenant, turn.candidate))
        row = await cur.fetchone()
        if row is None:
            return None
        rollout_id, live, state_json = int(row[0]), str(row[1]), row[2]
        if turn.config_version not in (turn.candidate, live):
            return None
        canary = turn.config_version == turn.candidate
        state = RolloutState.from_dict(state_json) if state_json else RolloutState()
        state.observe(
            self.config,
            canary=canary,
            reward=turn.reward,
            cost=turn.cost_usd,
            failed=turn.failed,
            utility=turn.utility,
        )
        evidence = decide(state, self.config)
        decided = evidence.decision != Decision.CONTINUE
        payload = finite(evidence.to_dict())
        if decided:
            await decide_canary(conn, turn.tenant, live, turn.candidate, evidence.decision.value, payload)
        cur = await conn.execute(
            UPDATE_RUN_SQL,
            (
                Jsonb(state.to_dict()),
                Jsonb(finite(asdict(self.config))),
                Jsonb(payload),
                evidence.decision.value if decided else None,
                evidence.reason.value if decided else None,
                decided,
                rollout_id,
            ),
        )
        turns, decided_at = await cur.fetchone() or (0, None)
        return Observed(
            rollout_id,
            turn.tenant,
            live,
            turn.candidate,
            "canary" if canary else "live",
            turn.arm,
            turn.reward,
            turn.cost_usd,
            evidence,
            int(turns),
            decided_at,
        )

    async def mark_published(self, rollout_id: int) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(
                "UPDATE router_rollouts SET published_at = now() WHERE rollout_id = %s", (rollout_id,)
            )

    async def unpublished(self) -> list[ev.PolicyDecision]:
        """Decided runs whose PolicyDecision was never published (the router stopped in between)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(UNPUBLISHED_SQL)
            rows = await cur.fetchall()
        return [decision_event(int(r[0]), r[1], r[2], r[3], dict(r[5]), r[6]) for r in rows]
