"""The operators' side of policy versions (`mars policy`, mars_tools.policy_cli): create a version, give it a
role (live, shadow), promote a shadow, roll back, and read the log a comparison rests on.

Every change runs in one transaction under a per-tenant advisory lock, writes its audit row in
router_policy_changes with the roles it changes, and is routed by every replica within
MARS_ROUTER_POLICY_CONFIG_TTL_S (mars_router.versions). Versions themselves are immutable (a trigger refuses
UPDATE and DELETE): a change of config is a new version. Over a sync psycopg connection (the CLI's)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from mars.domain.ope import LoggedComparison
from mars.domain.policy_versions import DEFAULT_VERSION, PolicyConfig
from psycopg.types.json import Jsonb

from mars_router.versions import config_of_row

_VERSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
#: Every change of a tenant's roles (and a canary run's decision, mars_router.rollouts) holds this first.
LOCK_SQL = "SELECT pg_advisory_xact_lock(hashtext('router-policy:' || %s))"
_LOCK_SQL = LOCK_SQL
AUDIT_SQL = (
    "INSERT INTO router_policy_changes (tenant, action, role, from_version, to_version, actor, evidence) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING change_id, changed_at"
)
SET_LIVE_SQL = (
    "INSERT INTO router_policy_roles (tenant, role, version) VALUES (%s, 'live', %s) "
    "ON CONFLICT (tenant, role) DO UPDATE SET version = EXCLUDED.version, since = now()"
)
#: A version is live or a candidate, never both.
DROP_CANDIDATE_ROLES_SQL = (
    "DELETE FROM router_policy_roles WHERE tenant = %s AND role <> 'live' AND version = %s"
)
DROP_ROLE_SQL = "DELETE FROM router_policy_roles WHERE tenant = %s AND role = %s"
#: Ends the tenant's open canary run (an operator's change of its roles: the run's comparison is gone).
STOP_ROLLOUT_SQL = (
    "UPDATE router_rollouts SET decision = 'stopped', rule = %s, decided_at = now(), updated_at = now() "
    "WHERE tenant = %s AND decided_at IS NULL"
)
_VERSION_COLUMNS = (
    "version, created_at, algorithm, params, feature_set, lambda_cost, arms, content_hash, note, created_by"
)


class PolicyAdminError(ValueError):
    """A policy change that cannot be made (unknown tenant or version, a role it cannot take)."""


@dataclass(frozen=True)
class VersionRow:
    tenant: str
    version: str
    created_at: datetime
    config: PolicyConfig
    content_hash: str
    note: str
    created_by: str


@dataclass(frozen=True)
class Change:
    change_id: int
    action: str
    role: str
    from_version: str | None
    to_version: str | None
    actor: str
    evidence: dict[str, Any]
    changed_at: datetime


def _version_row(tenant: str, row: Sequence[Any]) -> VersionRow:
    version, created_at, *config, content_hash, note, created_by = row
    return VersionRow(tenant, str(version), created_at, config_of_row(config), content_hash, note, created_by)


def _audit(
    conn: Any,
    tenant: str,
    action: str,
    role: str,
    from_version: str | None,
    to_version: str | None,
    actor: str,
    evidence: dict[str, Any],
) -> Change:
    row = conn.execute(
        AUDIT_SQL, (tenant, action, role, from_version, to_version, actor, Jsonb(evidence))
    ).fetchone()
    return Change(int(row[0]), action, role, from_version, to_version, actor, evidence, row[1])


def next_version_id(conn: Any, tenant: str) -> str:
    """v<N>, one past the tenant's highest numbered version."""
    rows = conn.execute("SELECT version FROM router_policy_versions WHERE tenant = %s", (tenant,)).fetchall()
    numbers = [int(v[1:]) for (v,) in rows if re.fullmatch(r"v\d+", v)]
    return f"v{max(numbers, default=0) + 1}"


def create_version(
    conn: Any,
    tenant: str,
    config: PolicyConfig,
    known_arms: Sequence[str],
    version: str | None = None,
    note: str = "",
    actor: str = "",
) -> VersionRow:
    """Store `config` as a new version of the tenant's (named `version`, else the next v<N>)."""
    config.check_arms(known_arms)
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        version = version or next_version_id(conn, tenant)
        if version == DEFAULT_VERSION or not _VERSION_ID.match(version):
            raise PolicyAdminError(
                f"version id {version!r}: letters, digits, '.', '_' or '-' (64 at most), and not 'default'"
            )
        if get_version(conn, tenant, version, missing_ok=True) is not None:
            raise PolicyAdminError(
                f"tenant {tenant} already has a version {version} (versions are immutable)"
            )
        d = config.to_dict()
        conn.execute(
            "INSERT INTO router_policy_versions (tenant, version, algorithm, params, feature_set, lambda_cost, "
            "arms, content_hash, note, created_by) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                tenant,
                version,
                d["algorithm"],
                Jsonb(d["params"]),
                d["feature_set"],
                d["lambda"],
                list(config.arms),
                config.content_hash(),
                note,
                actor,
            ),
        )
        _audit(conn, tenant, "create", "", None, version, actor, {"config": d, "note": note})
    row = get_version(conn, tenant, version)
    assert row is not None
    return row


def get_version(conn: Any, tenant: str, version: str, missing_ok: bool = False) -> VersionRow | None:
    row = conn.execute(
        f"SELECT {_VERSION_COLUMNS} FROM router_policy_versions WHERE tenant = %s AND version = %s",
        (tenant, version),
    ).fetchone()
    if row is None:
        if missing_ok:
            return None
        known = [v.version for v in list_versions(conn, tenant)]
        if not known:
            raise PolicyAdminError(
                f"tenant {tenant!r} has no policy versions (create one: mars policy create)"
            )
        raise PolicyAdminError(f"tenant {tenant!r} has no version {version!r}; it has {', '.join(known)}")
    return _version_row(tenant, row)


def list_versions(conn: Any, tenant: str) -> list[VersionRow]:
    rows = conn.execute(
        f"SELECT {_VERSION_COLUMNS} FROM router_policy_versions WHERE tenant = %s ORDER BY created_at, version",
        (tenant,),
    ).fetchall()
    return [_version_row(tenant, r) for r in rows]


def tenants(conn: Any) -> list[str]:
    """Tenants with at least one version."""
    return [str(r[0]) for r in conn.execute("SELECT DISTINCT tenant FROM router_policy_versions ORDER BY 1")]


def roles(conn: Any, tenant: str) -> dict[str, str]:
    """Role -> version; "live" is "default" when no version is live."""
    rows = conn.execute(
        "SELECT role, version FROM router_policy_roles WHERE tenant = %s", (tenant,)
    ).fetchall()
    return {"live": DEFAULT_VERSION} | {str(role): str(version) for role, version in rows}


def changes(conn: Any, tenant: str, limit: int = 50) -> list[Change]:
    rows = conn.execute(
        "SELECT change_id, action, role, from_version, to_version, actor, evidence, changed_at "
        "FROM router_policy_changes WHERE tenant = %s ORDER BY change_id DESC LIMIT %s",
        (tenant, limit),
    ).fetchall()
    return [Change(int(r[0]), r[1], r[2], r[3], r[4], r[5], dict(r[6]), r[7]) for r in rows]


def _set_live(conn: Any, tenant: str, version: str) -> None:
    # The open canary run compared against the live version (or was the candidate being made live):
    # either way its comparison ends here, as does its split.
    _stop_canary(conn, tenant, f"live set to {version} by an operator")
    if version == DEFAULT_VERSION:
        conn.execute(DROP_ROLE_SQL, (tenant, "live"))
        return
    conn.execute(SET_LIVE_SQL, (tenant, version))
    conn.execute(DROP_CANDIDATE_ROLES_SQL, (tenant, version))


def _stop_canary(conn: Any, tenant: str, why: str) -> None:
    conn.execute(STOP_ROLLOUT_SQL, (why, tenant))
    conn.execute(DROP_ROLE_SQL, (tenant, "canary"))


def _check_beside_live(conn: Any, tenant: str, current: dict[str, str], version: str, role: str) -> None:
    """A shadow or canary version must exist and must not be the live one."""
    get_version(conn, tenant, version)
    if current["live"] == version:
        raise PolicyAdminError(f"{version} is live for tenant {tenant}; a {role} must be another version")


def set_canary(
    conn: Any,
    tenant: str,
    version: str | None,
    initial_state: dict[str, Any],
    actor: str = "",
    reason: str = "",
) -> Change:
    """Start a canary run of `version` against the live version (None: stop the open run): the router
    routes a share of the tenant's sessions by it and decides by the sequential test (mars_router.rollouts).
    `initial_state`: the test's empty state (mars.domain.rollout.RolloutState().to_dict())."""
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        current = roles(conn, tenant)
        before = current.get("canary")
        if version is None:
            if before is None:
                raise PolicyAdminError(f"tenant {tenant} has no canary version")
            _stop_canary(conn, tenant, f"stopped by {actor or 'an operator'}")
        else:
            _check_beside_live(conn, tenant, current, version, "canary")
            _stop_canary(conn, tenant, f"replaced by a canary of {version}")
            conn.execute(
                "INSERT INTO router_policy_roles (tenant, role, version) VALUES (%s, 'canary', %s)",
                (tenant, version),
            )
            conn.execute(
                "INSERT INTO router_rollouts (tenant, live_version, candidate_version, state) "
                "VALUES (%s, %s, %s, %s)",
                (tenant, current["live"], version, Jsonb(initial_state)),
            )
        return _audit(conn, tenant, "canary", "canary", before, version, actor, {"reason": reason})


@dataclass(frozen=True)
class Rollout:
    """A canary run (router_rollouts), as `mars policy canary --status` shows it."""

    rollout_id: int
    live_version: str
    candidate_version: str
    started_at: datetime
    turns: int
    decision: str | None
    rule: str | None
    evidence: dict[str, Any] | None
    decided_at: datetime | None


def rollouts(conn: Any, tenant: str, limit: int = 10) -> list[Rollout]:
    """The tenant's canary runs, newest first."""
    rows = conn.execute(
        "SELECT rollout_id, live_version, candidate_version, started_at, turns, decision, rule, evidence, "
        "decided_at FROM router_rollouts WHERE tenant = %s ORDER BY rollout_id DESC LIMIT %s",
        (tenant, limit),
    ).fetchall()
    return [Rollout(int(r[0]), r[1], r[2], r[3], int(r[4]), r[5], r[6], r[7], r[8]) for r in rows]


def activate(conn: Any, tenant: str, version: str, actor: str = "", reason: str = "") -> Change:
    """Make `version` the tenant's live version ("default": the router's settings again)."""
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        if version != DEFAULT_VERSION:
            get_version(conn, tenant, version)
        current = roles(conn, tenant)["live"]
        if current == version:
            raise PolicyAdminError(f"{version} is already live for tenant {tenant}")
        _set_live(conn, tenant, version)
        return _audit(conn, tenant, "activate", "live", current, version, actor, {"reason": reason})


def set_shadow(conn: Any, tenant: str, version: str | None, actor: str = "", reason: str = "") -> Change:
    """Run `version` in shadow beside the live one (None: stop the shadow)."""
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        current = roles(conn, tenant)
        before = current.get("shadow")
        if version is None:
            if before is None:
                raise PolicyAdminError(f"tenant {tenant} has no shadow version")
            conn.execute("DELETE FROM router_policy_roles WHERE tenant = %s AND role = 'shadow'", (tenant,))
        else:
            _check_beside_live(conn, tenant, current, version, "shadow")
            conn.execute(
                "INSERT INTO router_policy_roles (tenant, role, version) VALUES (%s, 'shadow', %s) "
                "ON CONFLICT (tenant, role) DO UPDATE SET version = EXCLUDED.version, since = now()",
                (tenant, version),
            )
        return _audit(conn, tenant, "shadow", "shadow", before, version, actor, {"reason": reason})


def promote(
    conn: Any, tenant: str, role: str = "shadow", actor: str = "", evidence: dict[str, Any] | None = None
) -> Change:
    """Make the tenant's shadow (or canary) version live; its evidence (a comparison) goes in the audit row."""
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        current = roles(conn, tenant)
        candidate = current.get(role)
        if candidate is None:
            raise PolicyAdminError(f"tenant {tenant} has no {role} version to promote")
        _set_live(conn, tenant, candidate)
        return _audit(conn, tenant, "promote", role, current["live"], candidate, actor, evidence or {})


def rollback(conn: Any, tenant: str, actor: str = "", reason: str = "") -> Change:
    """Back to the version that was live before the current one (the from_version of the activate or promote
    that made it live: repeated, it walks back through the history)."""
    with conn.transaction():
        conn.execute(_LOCK_SQL, (tenant,))
        current = roles(conn, tenant)["live"]
        row = conn.execute(
            "SELECT from_version FROM router_policy_changes WHERE tenant = %s AND action IN ('activate', 'promote') "
            "AND to_version = %s ORDER BY change_id DESC LIMIT 1",
            (tenant, current),
        ).fetchone()
        if row is None or row[0] is None:
            raise PolicyAdminError(
                f"tenant {tenant}: live version {current} was not activated or promoted; nothing to roll back to"
            )
        target = str(row[0])
        _set_live(conn, tenant, target)
        return _audit(conn, tenant, "rollback", "live", current, target, actor, {"reason": reason})


#: A shadow version's logged turns beside the live decisions, with the judged reward of the live arm (the
#: turns a fallback answered are left out: their reward is another arm's than the one whose propensity is
#: logged).
LOGGED_SQL = (
    "SELECT d.features, d.arm, d.propensity, l.reward, s.arm, s.propensity FROM router_shadow_decisions s "
    "JOIN router_decisions d ON d.turn_id = s.turn_id JOIN router_ledger l ON l.turn_id = s.turn_id "
    "WHERE s.tenant = %s AND s.version = %s AND d.propensity IS NOT NULL AND l.arm = d.arm "
    "ORDER BY s.created_at DESC LIMIT %s"
)


def logged_comparison(
    conn: Any, tenant: str, version: str, limit: int = 100_000
) -> tuple[list[LoggedComparison], list[str]]:
    """The shadow version's judged turns as OPE rows, and the arm order their indices refer to."""
    rows = conn.execute(LOGGED_SQL, (tenant, version, limit)).fetchall()
    if rows:
        # One reward model over one feature space: the turns of the live feature set most of them had.
        dims = [len(r[0]) for r in rows]
        dim = max(set(dims), key=dims.count)
        rows = [r for r in rows if len(r[0]) == dim]
    arms = sorted({str(r[1]) for r in rows} | {str(r[4]) for r in rows})
    index = {a: i for i, a in enumerate(arms)}
    out = [
        LoggedComparison(
            np.asarray(features, dtype=np.float64),
            index[arm],
            float(p),
            float(reward),
            index[s_arm],
            float(s_p),
        )
        for features, arm, p, reward, s_arm, s_p in rows
    ]
    return out, arms


async def decide_canary(
    aconn: Any, tenant: str, live: str, candidate: str, decision: str, evidence: dict[str, Any]
) -> None:
    """A canary run's decision made by the router (mars_router.rollouts), in the judged turn's transaction
    (which holds LOCK_SQL): "promote" makes the candidate live; "rollback" and "undecided" drop the canary
    role (live stays). The audit row (actor "router", role "canary") carries the evidence. Over an async
    connection, with the statements the operators' changes use."""
    if decision == "promote":
        await aconn.execute(SET_LIVE_SQL, (tenant, candidate))
        await aconn.execute(DROP_CANDIDATE_ROLES_SQL, (tenant, candidate))
        action, from_version, to_version = "promote", live, candidate
    else:
        await aconn.execute(DROP_ROLE_SQL, (tenant, "canary"))
        action, from_version, to_version = decision, candidate, live
    await aconn.execute(
        AUDIT_SQL, (tenant, action, "canary", from_version, to_version, "router", Jsonb(evidence))
    )
