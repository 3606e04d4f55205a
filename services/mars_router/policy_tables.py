"""A router's policies as rows: router_policies (one per policy id; its version counts resets) and
router_arms (each arm's LinUCB matrices, pull count, reward sum and row version). Creating a policy (cold,
or warm-started from its tenant's), reading one for a turn, and resetting one; the reward updates that
change arm rows are mars_router.rewards'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mars.domain.features import FEATURE_DIM, QUERY_FEATURE_DIM, RECENT_TURNS
from mars.domain.linucb import ArmModel
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from mars_router.settings import RouterSettings

#: The feature vectors of a session's last routed turns before one turn (its phases, mars.domain.features).
PHASES_SQL = (
    "SELECT features FROM router_decisions WHERE session_key = %s AND turn_id <> %s "
    "ORDER BY created_at DESC LIMIT %s"
)
#: Policy ids this process remembers as created; past this many it forgets them all and checks again.
MAX_ENSURED = 100_000


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


def dim_of_policy(policy_id: str, default: int = FEATURE_DIM) -> int:
    """The feature dimension of a policy's matrices from its id: a query-embedding policy's ids carry
    "#query" (`policy_id_for`), a state policy's are `default` (the state map's, or the router's own)."""
    if "#query" in policy_id:
        return QUERY_FEATURE_DIM
    if "#v=" in policy_id:
        return FEATURE_DIM  # a state-feature version (mars_router.versions.versioned_policy_id)
    return default


class PolicyCorrupt(Exception):
    """A stored policy's matrices failed the sanity check (non-finite, A not positive definite)."""


@dataclass(frozen=True)
class PolicyRead:
    """A policy as read for one turn: its arm models and version, or why it is refused."""

    models: dict[str, ArmModel]
    version: int
    #: Set when the stored matrices failed the sanity check: the turn goes to the default arm.
    corrupt: str | None = None


class PolicyTables:
    def __init__(
        self,
        pool: AsyncConnectionPool,
        settings: RouterSettings,
        arms: list[str],
        feature_space: str,
        dim: int,
    ) -> None:
        self._pool = pool
        self._settings = settings
        self._arms = arms
        self._feature_space = feature_space
        self._dim = dim
        #: Policies this process has created or found (with every arm's row): not written again per turn.
        self._ensured: set[str] = set()

    async def ensure(self, conn: AsyncConnection, policy_id: str) -> None:
        """Create the policy and every arm's row where missing; a new user policy starts from its tenant's
        matrices when MARS_ROUTER_WARM_START_FROM_TENANT is on."""
        cur = await conn.execute(
            "INSERT INTO router_policies (policy_id, scope, dim, alpha, ridge) VALUES (%s, %s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING RETURNING policy_id",
            (policy_id, self._settings.policy_scope, self._dim, self._settings.alpha, self._settings.ridge),
        )
        created = await cur.fetchone() is not None
        cold = ArmModel.cold(self._dim, self._settings.ridge).to_bytes()
        seed: dict[str, bytes] = {}
        if created and self._settings.warm_start_from_tenant and policy_id.startswith("user:"):
            # A new user's policy starts from its tenant's matrices (pull counts start at zero).
            tenant = policy_id[len("user:") :].split("/", 1)[0]
            cur = await conn.execute(
                "SELECT arm, model FROM router_arms WHERE policy_id = %s",
                (policy_id_for("tenant", tenant, "", self._feature_space),),
            )
            seed = {str(arm): bytes(blob) for arm, blob in await cur.fetchall()}
        for arm in self._arms:
            await conn.execute(
                "INSERT INTO router_arms (policy_id, arm, model) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (policy_id, arm, seed.get(arm, cold)),
            )

    async def read(
        self, policy_id: str, phases_of: tuple[str, str] | None
    ) -> tuple[PolicyRead, list[tuple[Any, ...]]]:
        """The policy (created when new) and, for (session_key, turn_id), the session's recent decision
        rows, pipelined in one round trip. The version is resets plus arm updates, so it grows with every
        applied reward without a policy-wide row that every update would have to lock."""
        async with self._pool.connection() as conn:
            if policy_id not in self._ensured:
                await self.ensure(conn, policy_id)
            async with conn.pipeline() as pipeline:
                phases_cur = None
                if phases_of is not None and self._feature_space == "state":
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
            return await self.read(policy_id, phases_of)
        if len(self._ensured) > MAX_ENSURED:
            self._ensured.clear()
        self._ensured.add(policy_id)
        return self._policy(policy_id, row, rows), phase_rows

    def _policy(self, policy_id: str, row: tuple[Any, ...] | None, rows: list[tuple[Any, ...]]) -> PolicyRead:
        """The PolicyRead of a policy row and its arm rows, with the first arm that fails its sanity check."""
        version = int(row[0]) if row else 0
        models = {
            arm: ArmModel.from_bytes(bytes(blob), self._dim, int(pulls), float(reward_sum))
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
        return PolicyRead({a: models[a] for a in self._arms if a in models}, version, corrupt)

    async def reset(self, policy_id: str) -> None:
        """Back to the cold start; the ledger stays, so rewards already applied are never re-applied."""
        cold = ArmModel.cold(self._dim, self._settings.ridge).to_bytes()
        async with self._pool.connection() as conn, conn.transaction():
            await self.ensure(conn, policy_id)
            await conn.execute(
                "UPDATE router_arms SET model = %s, pulls = 0, reward_sum = 0, version = version + 1 "
                "WHERE policy_id = %s",
                (cold, policy_id),
            )
            await conn.execute(
                "UPDATE router_policies SET version = version + 1 WHERE policy_id = %s", (policy_id,)
            )
