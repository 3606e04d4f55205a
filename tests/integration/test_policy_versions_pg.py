"""Policy versions on a real Postgres (issue 47, items 1, 2 and 4): immutable versions, one live per tenant,
a change seen by a second router replica within about a second, a shadow that decides every turn beside the
live policy without changing it and learns from matched turns in the live update's transaction (a
redelivered reward updates neither twice), promote and rollback with their audit rows, and `mars policy
compare` on the logged turns."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import psycopg
import pytest
from mars import db
from mars.domain.features import FEATURE_DIM
from mars.domain.policy_versions import PolicyConfig, PolicyConfigError
from mars.model_pool import ModelPool, ModelSpec
from mars.v1 import events_pb2 as ev
from mars_router import policy_admin as admin
from mars_router.rewards import version_reward
from mars_router.schema import MIGRATIONS
from mars_router.service import RouterStage
from mars_router.settings import RouterSettings
from mars_router.store import PolicyStore
from psycopg_pool import AsyncConnectionPool

pytestmark = pytest.mark.integration
ARMS = ["small", "large"]
#: The simulated environment: "large" answers better.
REWARD = {"small": 0.3, "large": 0.8}
JUDGE_LAMBDA, COST = 0.5, 0.2


def pool_cfg() -> ModelPool:
    spec = {
        "base_url": "http://127.0.0.1:9",
        "context_window": 4096,
        "output_reserve": 256,
        "safety_margin": 0,
    }
    return ModelPool(
        models=[
            ModelSpec(name=a, input_price_per_m=p, output_price_per_m=p, **spec)  # type: ignore[arg-type]
            for a, p in (("small", 0.1), ("large", 1.0))
        ]
    )


async def replica(dsn: str, **kw: Any) -> tuple[PolicyStore, RouterStage, AsyncConnectionPool]:
    """One router replica: its own pool, store and routing stage (no Kafka: `_route` builds the event)."""
    pool = await db.open_pool(dsn)
    await db.migrate(pool, "router", MIGRATIONS)
    settings = RouterSettings(postgres_dsn=dsn, **{"policy_scope": "tenant", "routing_seed": 7, **kw})  # type: ignore[arg-type]
    store = PolicyStore(pool, settings, ARMS)
    stage = RouterStage(store, pool_cfg(), SimpleNamespace(ledger=None), pool, settings)  # type: ignore[arg-type]
    return store, stage, pool


def view(tenant: str, seq: int) -> ev.ViewBuilt:
    rng = np.random.default_rng(seq)
    state = ev.SessionState(
        action=ev.MATCH if seq % 2 else ev.NEW_TOPIC,
        query_type=int(rng.integers(1, 5)),  # type: ignore[arg-type]
        phase=ev.EXPLORE,
        thread_depth=int(rng.integers(1, 12)),
        top_k_hint=int(rng.integers(1, 8)),
    )
    turn = ev.TurnEnvelope(tenant=tenant, user_id="u1", session_id="s1", turn_id=f"{tenant}-{seq}", seq=seq)
    return ev.ViewBuilt(turn=turn, state=state)


def sync_conn(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`mars policy ...` as an operator runs it, this checkout's code first."""
    env = {**os.environ, "MARS_POSTGRES_DSN": dsn, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", "from mars_tools.cli import main; main()", "policy", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_versions_are_immutable_and_a_tenant_has_one_live(postgres: str) -> None:
    async def migrate() -> None:
        _, _, pool = await replica(postgres)
        await pool.close()

    asyncio.run(migrate())
    with sync_conn(postgres) as conn:
        v1 = admin.create_version(conn, "imm", PolicyConfig("linucb", tuple(ARMS), {"alpha": 0.5}), ARMS)
        v2 = admin.create_version(conn, "imm", PolicyConfig("thompson", ("large",)), ARMS, note="only large")
        assert (v1.version, v2.version) == ("v1", "v2") and v1.content_hash != v2.content_hash
        for sql in (
            "UPDATE router_policy_versions SET params = '{\"alpha\": 9}' WHERE tenant = 'imm'",
            "DELETE FROM router_policy_versions WHERE tenant = 'imm' AND version = 'v1'",
        ):
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation, match="immutable"):
                conn.execute(sql)
        assert admin.get_version(conn, "imm", "v1") == v1  # unchanged
        with pytest.raises(admin.PolicyAdminError, match="already has a version v1"):
            admin.create_version(conn, "imm", PolicyConfig("linucb", ("small",)), ARMS, version="v1")
        with pytest.raises(PolicyConfigError, match="not in the model pool"):
            admin.create_version(conn, "imm", PolicyConfig("linucb", ("huge",)), ARMS)
        with pytest.raises(admin.PolicyAdminError, match="not 'default'"):
            admin.create_version(conn, "imm", PolicyConfig("linucb", ("small",)), ARMS, version="default")

        assert admin.roles(conn, "imm") == {"live": "default"}
        admin.activate(conn, "imm", "v1", "tester")
        admin.activate(conn, "imm", "v2", "tester")
        live_rows = conn.execute(
            "SELECT version FROM router_policy_roles WHERE tenant = 'imm' AND role = 'live'"
        )
        assert live_rows.fetchall() == [("v2",)]
        with pytest.raises(psycopg.errors.UniqueViolation):  # a second live row, written by hand
            conn.execute(
                "INSERT INTO router_policy_roles (tenant, role, version) VALUES ('imm', 'live', 'v1')"
            )
        with pytest.raises(admin.PolicyAdminError, match="already live"):
            admin.activate(conn, "imm", "v2")
        with pytest.raises(admin.PolicyAdminError, match="a shadow must be another version"):
            admin.set_shadow(conn, "imm", "v2")
        with pytest.raises(admin.PolicyAdminError, match="has no version 'v9'; it has v1, v2"):
            admin.activate(conn, "imm", "v9")
        with pytest.raises(admin.PolicyAdminError, match="'nobody' has no policy versions"):
            admin.set_shadow(conn, "nobody", "v1")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):  # a role names a stored version
            conn.execute(
                "INSERT INTO router_policy_roles (tenant, role, version) VALUES ('imm', 'canary', 'v7')"
            )
        actions = [(c.action, c.from_version, c.to_version) for c in reversed(admin.changes(conn, "imm"))]
        assert actions == [
            ("create", None, "v1"),
            ("create", None, "v2"),
            ("activate", "default", "v1"),
            ("activate", "v1", "v2"),
        ]


def test_a_change_reaches_a_second_replica_within_a_second(postgres: str) -> None:
    """Replica B has the tenant's roles cached when the operator activates, promotes and rolls back; each
    change routes B's turns within MARS_ROUTER_POLICY_CONFIG_TTL_S (0.5 s) plus the 10 ms polling step."""

    async def scenario() -> dict[str, float]:
        store_a, stage_a, pool_a = await replica(postgres)
        store_b, stage_b, pool_b = await replica(postgres)
        with sync_conn(postgres) as conn:
            admin.create_version(
                conn, "ttl", PolicyConfig("linucb", ("large", "small"), {"alpha": 0.3}), ARMS
            )
            admin.create_version(
                conn, "ttl", PolicyConfig("epsilon_greedy", tuple(ARMS), {"epsilon": 0.2}), ARMS
            )
        seen: dict[str, float] = {}
        seq = iter(range(1, 10_000))

        async def visible(what: str, change: Any, live: str) -> None:
            for store in (store_a, store_b):
                await store.policies("ttl")  # both replicas have the old roles cached
            with sync_conn(postgres) as conn:
                change(conn)
            t0 = time.monotonic()
            while (await stage_b._route(view("ttl", next(seq)))).config_version != live:
                assert time.monotonic() - t0 < 3.0, f"{what}: replica B still routes by the old version"
                await asyncio.sleep(0.01)
            seen[what] = time.monotonic() - t0

        await visible("activate v1", lambda c: admin.activate(c, "ttl", "v1"), "v1")
        routed = await stage_b._route(view("ttl", next(seq)))
        assert routed.policy_id == "tenant:ttl#v=v1" and routed.chosen_arm in ARMS
        with sync_conn(postgres) as conn:
            admin.set_shadow(conn, "ttl", "v2")
        await visible("promote v2", lambda c: admin.promote(c, "ttl"), "v2")
        routed = await stage_b._route(view("ttl", next(seq)))
        assert routed.policy_id == "tenant:ttl#v=v2" and routed.shadow_version == ""  # v2 is no shadow now
        await visible("rollback to v1", lambda c: admin.rollback(c, "ttl"), "v1")
        await visible("rollback to default", lambda c: admin.rollback(c, "ttl"), "default")
        # Replica A refilled its cache at the step's start, so it may hold the old roles up to one TTL after B
        # sees the change (B's entry could be older): it follows within the same bound, not at once.
        t0 = time.monotonic()
        while (await stage_a._route(view("ttl", next(seq)))).policy_id != "tenant:ttl":
            assert time.monotonic() - t0 < 3.0, "rollback to default: replica A still routes by v1"
            await asyncio.sleep(0.01)
        seen["rollback to default, replica A after B"] = time.monotonic() - t0
        for pool in (pool_a, pool_b):
            await pool.close()
        return seen

    seen = asyncio.run(scenario())
    print(
        "change visible on the second replica after: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in seen.items())
    )
    assert all(s < 1.0 for s in seen.values()), seen  # issue 47: on every replica within one second


def test_shadow_decides_beside_live_and_learns_matched_turns_once(postgres: str) -> None:
    """A uniform-random shadow (epsilon 1, its own lambda 0) beside the default LinUCB over 40 turns, each
    judged reward delivered twice, once to each of two replicas at the same time: every turn is applied once,
    the live policy's arms hold exactly its turns, the shadow's exactly the matched turns (at its own
    lambda's reward), and the live decisions are those of a tenant without a shadow."""
    n = 40

    async def scenario() -> None:
        store_a, stage_a, pool_a = await replica(postgres)
        store_b, _, pool_b = await replica(postgres)
        with sync_conn(postgres) as conn:
            admin.create_version(
                conn,
                "sh",
                PolicyConfig("epsilon_greedy", tuple(ARMS), {"epsilon": 1.0}, lambda_cost=0.0),
                ARMS,
            )
            admin.set_shadow(conn, "sh", "v1", "tester", "try it")
        shadowed: list[ev.Routed] = []
        solo: list[ev.Routed] = []
        for seq in range(1, n + 1):
            # The same turn for a tenant with a shadow and one without; the same rewards for both.
            for tenant, out in (("sh", shadowed), ("solo", solo)):
                routed = await stage_a._route(view(tenant, seq))
                out.append(routed)
                r = REWARD[routed.chosen_arm]
                applied = await asyncio.gather(
                    *(
                        s.apply_reward(routed.turn.turn_id, routed.chosen_arm, r, [], COST, JUDGE_LAMBDA)
                        for s in (store_a, store_b)
                    )
                )
                assert sorted(applied) == [False, True]  # the redelivery: no effect
        assert [r.chosen_arm for r in shadowed] == [
            r.chosen_arm for r in solo
        ]  # the shadow changes no answer
        assert {r.config_version for r in shadowed} == {"default"} and {
            r.shadow_version for r in shadowed
        } == {"v1"}
        assert {r.shadow_propensity for r in shadowed} == {0.5} and {r.shadow_version for r in solo} == {""}
        matched = [r for r in shadowed if r.shadow_arm == r.chosen_arm]
        assert 0 < len(matched) < n
        live, _ = await store_a.load("tenant:sh")
        shadow, _ = await store_a.load("tenant:sh#v=v1")
        for arm in ARMS:
            mine = [r for r in shadowed if r.chosen_arm == arm]
            xs = [np.asarray(r.features) for r in mine]
            assert live[arm].pulls == len(mine)
            np.testing.assert_allclose(
                live[arm].A,
                np.eye(FEATURE_DIM) + sum((np.outer(x, x) for x in xs), np.zeros((FEATURE_DIM,) * 2)),
            )
            np.testing.assert_allclose(live[arm].b, sum((REWARD[arm] * x for x in xs), np.zeros(FEATURE_DIM)))
            ours = [np.asarray(r.features) for r in matched if r.chosen_arm == arm]
            r_shadow = version_reward(REWARD[arm], 0.0, JUDGE_LAMBDA, COST)  # 0.1 above the judge's
            assert shadow[arm].pulls == len(ours)
            np.testing.assert_allclose(
                shadow[arm].A,
                np.eye(FEATURE_DIM) + sum((np.outer(x, x) for x in ours), np.zeros((FEATURE_DIM,) * 2)),
            )
            np.testing.assert_allclose(
                shadow[arm].b, sum((r_shadow * x for x in ours), np.zeros(FEATURE_DIM))
            )
        async with pool_a.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*), count(DISTINCT turn_id) FROM router_shadow_decisions WHERE tenant = 'sh'"
            )
            assert await cur.fetchone() == (n, n)
            cur = await conn.execute("SELECT count(*) FROM router_ledger WHERE turn_id LIKE 'sh-%%'")
            assert await cur.fetchone() == (n,)
            cur = await conn.execute(
                "SELECT count(*) FROM router_decisions WHERE tenant = 'sh' AND config_version = 'default' AND propensity = 1"
            )
            assert await cur.fetchone() == (n,)
        # A late correction of a matched turn moves both policies' b once; its redelivery nothing.
        turn = matched[0]
        x = np.asarray(turn.features)
        assert await store_b.apply_correction(
            f"{turn.turn.turn_id}#feedback-1", turn.turn.turn_id, turn.chosen_arm, -0.2
        )
        assert not await store_a.apply_correction(
            f"{turn.turn.turn_id}#feedback-1", turn.turn.turn_id, turn.chosen_arm, -0.2
        )
        live2, _ = await store_a.load("tenant:sh")
        shadow2, _ = await store_a.load("tenant:sh#v=v1")
        np.testing.assert_allclose(live2[turn.chosen_arm].b, live[turn.chosen_arm].b - 0.2 * x)
        np.testing.assert_allclose(shadow2[turn.chosen_arm].b, shadow[turn.chosen_arm].b - 0.2 * x)
        for pool in (pool_a, pool_b):
            await pool.close()

    asyncio.run(scenario())


def test_compare_promote_and_rollback_through_the_cli(postgres: str) -> None:
    """120 judged turns of a shadow that prefers "large" (the better arm) beside the default LinUCB; the
    CLI's compare, promote (with the comparison as evidence) and rollback, and its errors."""

    async def seed() -> None:
        store, stage, pool = await replica(postgres)
        with sync_conn(postgres) as conn:
            admin.create_version(
                conn,
                "cmp",
                PolicyConfig("linucb", ("large", "small"), {"alpha": 0.0}),
                ARMS,
                note="large first",
            )
            admin.set_shadow(conn, "cmp", "v1")
        for seq in range(1, 121):  # routed, then judged, turn by turn: the live policy learns as it goes
            routed = await stage._route(view("cmp", seq))
            noise = 0.05 * np.sin(seq)
            await store.apply_reward(
                routed.turn.turn_id, routed.chosen_arm, REWARD[routed.chosen_arm] + noise, []
            )
        await pool.close()

    asyncio.run(seed())
    compared = cli(postgres, "compare", "cmp", "--json", "--bootstrap", "200")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    result = json.loads(compared.stdout.strip().splitlines()[-1])
    print(f"mars policy compare cmp --json: {compared.stdout.strip().splitlines()[-1]}")
    assert result["candidate"] == "v1" and result["turns"] == 120
    assert result["matched"] > 0 and result["ess"] == pytest.approx(result["matched"])  # weights 0 or 1
    snips, live = result["snips"], result["live"]
    assert snips["low"] <= snips["value"] <= snips["high"] and live["low"] <= live["value"] <= live["high"]
    # The candidate always plays "large": its matched turns are "large" turns, worth 0.8.
    assert snips["value"] == pytest.approx(0.8, abs=0.06) and snips["value"] > live["value"]
    text = cli(postgres, "compare", "cmp")
    assert "SNIPS" in text.stdout and "effective sample size" in text.stdout, text.stdout
    print(text.stdout)

    promoted = cli(postgres, "promote", "cmp", "--reason", "better on the log", "--actor", "ops")
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    with sync_conn(postgres) as conn:
        assert admin.roles(conn, "cmp") == {"live": "v1"}
        last = admin.changes(conn, "cmp", 1)[0]
        assert (last.action, last.from_version, last.to_version, last.actor) == (
            "promote",
            "default",
            "v1",
            "ops",
        )
        assert last.evidence["reason"] == "better on the log" and last.evidence["snips"][
            "value"
        ] == pytest.approx(snips["value"])
    back = cli(postgres, "rollback", "cmp", "--reason", "drill")
    assert back.returncode == 0 and "default" in back.stdout, back.stdout + back.stderr
    again = cli(postgres, "rollback", "cmp")
    assert again.returncode == 2 and "nothing to roll back to" in again.stdout, again.stdout
    with sync_conn(postgres) as conn:
        assert admin.roles(conn, "cmp") == {"live": "default"}
        assert [c.action for c in reversed(admin.changes(conn, "cmp"))] == [
            "create",
            "shadow",
            "promote",
            "rollback",
        ]

    unknown = cli(postgres, "activate", "cmp", "v9")
    assert unknown.returncode == 2 and "has no version 'v9'" in unknown.stdout, unknown.stdout
    nobody = cli(postgres, "list", "nobody")
    assert nobody.returncode == 2 and "no policy versions" in nobody.stdout, nobody.stdout
    bad = cli(postgres, "create", "cmp", "--algorithm", "linucb", "--param", "alpha=-1", "--arms", "small")
    assert bad.returncode == 2 and "alpha=-1.0 is outside [0, 100]" in bad.stdout, bad.stdout
    shown = cli(postgres, "show", "cmp", "v1")
    assert shown.returncode == 0 and '"alpha": 0.0' in shown.stdout and "promote" in shown.stdout, (
        shown.stdout
    )


def test_a_broken_shadow_never_holds_up_the_live_update(postgres: str) -> None:
    """The shadow's matrices fail their sanity check: it sits the turn's update out (and its correction's),
    the live policy learns as ever."""
    from mars.domain.linucb import ArmModel

    async def scenario() -> None:
        store, stage, pool = await replica(postgres)
        with sync_conn(postgres) as conn:
            admin.create_version(conn, "brk", PolicyConfig("linucb", ("small",)), ARMS)  # always "small"
            admin.set_shadow(conn, "brk", "v1")
        routed = await stage._route(view("brk", 1))
        while routed.chosen_arm != "small":  # a matched turn: the shadow would learn from it
            routed = await stage._route(view("brk", routed.turn.seq + 1))
        bad = ArmModel.cold(FEATURE_DIM)
        bad.A[0, 0] = float("nan")
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE router_arms SET model = %s WHERE policy_id = 'tenant:brk#v=v1'", (bad.to_bytes(),)
            )
        before, _ = await store.load("tenant:brk")
        assert await store.apply_reward(routed.turn.turn_id, "small", 0.5, [])
        assert await store.apply_correction(
            f"{routed.turn.turn_id}#feedback-1", routed.turn.turn_id, "small", 0.1
        )
        after, _ = await store.load("tenant:brk")
        assert after["small"].pulls == before["small"].pulls + 1
        np.testing.assert_allclose(after["small"].b, before["small"].b + 0.6 * np.asarray(routed.features))
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT pulls FROM router_arms WHERE policy_id = 'tenant:brk#v=v1'")
            assert await cur.fetchall() == [(0,)]
        await pool.close()

    asyncio.run(scenario())
