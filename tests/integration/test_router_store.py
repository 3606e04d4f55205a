"""Router policies in a real Postgres: concurrency, idempotency, restart, bad input, corrupt matrices."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mars import db
from mars.bus.codec import PoisonEvent
from mars.domain.features import FEATURE_DIM
from mars.domain.linucb import ArmModel
from mars_router.schema import MIGRATIONS
from mars_router.settings import RouterSettings
from mars_router.store import PolicyStore
from mars_stack import LocalStack, StackSettings

pytestmark = pytest.mark.integration
ARMS = ["small", "large"]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    stack = LocalStack(
        StackSettings(
            workdir=tmp_path_factory.mktemp("rpg"), start_llm=False, start_broker=False, services=()
        )
    ).start()
    try:
        yield stack.env["MARS_POSTGRES_DSN"]
    finally:
        stack.stop()


async def store_for(dsn: str, **kw: object) -> tuple[PolicyStore, object]:
    pool = await db.open_pool(dsn)
    await db.migrate(pool, "router", MIGRATIONS)
    settings = RouterSettings(postgres_dsn=dsn, **{"policy_scope": "global", **kw})  # type: ignore[arg-type]
    return PolicyStore(pool, settings, ARMS), pool


def features(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.uniform(0, 1, FEATURE_DIM)


def test_two_router_processes_lose_no_update(dsn: str) -> None:
    n = 40
    jobs = {w: [[f"conc-{w}-{i}", ARMS[i % 2], 0.5 + 0.01 * i] for i in range(n)] for w in (0, 1)}

    async def prepare() -> None:
        store, pool = await store_for(dsn)
        await store.load("global")
        for items in jobs.values():
            for turn_id, arm, _ in items:
                await store.record_decision(
                    str(turn_id), "global", str(arm), features(hash(turn_id) % 10_000)
                )
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(prepare())
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "router_worker.py"), dsn, json.dumps(items), json.dumps(ARMS)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for items in jobs.values()
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    conflicts = sum(json.loads(out.strip().splitlines()[-1])["update_conflicts"] for out in outputs)
    print(f"optimistic update conflicts retried: {conflicts}")

    async def check() -> None:
        store, pool = await store_for(dsn)
        models, version = await store.load("global")
        assert version == 2 * n
        for arm in ARMS:
            xs = [features(hash(t) % 10_000) for items in jobs.values() for t, a, _ in items if a == arm]
            rs = [r for items in jobs.values() for _, a, r in items if a == arm]
            expected_a = np.eye(FEATURE_DIM) + sum(np.outer(x, x) for x in xs)
            expected_b = sum(r * x for x, r in zip(xs, rs, strict=True))
            assert models[arm].pulls == len(xs)
            np.testing.assert_allclose(models[arm].A, expected_a, rtol=1e-9)
            np.testing.assert_allclose(models[arm].b, expected_b, rtol=1e-9)
            np.testing.assert_allclose(models[arm].A_inv @ models[arm].A, np.eye(FEATURE_DIM), atol=1e-6)
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(check())


def test_replay_restart_and_bad_input(dsn: str) -> None:
    async def scenario() -> None:
        store, pool = await store_for(dsn)
        await store.load("global")
        x = features(7)
        await store.record_decision("r-1", "global", "small", x)
        assert await store.apply_reward("r-1", "small", 0.7, []) is True
        before, v1 = await store.load("global")
        assert await store.apply_reward("r-1", "small", 0.7, []) is False  # replay: no effect
        after, v2 = await store.load("global")
        assert v1 == v2 and after["small"].to_bytes() == before["small"].to_bytes()
        await pool.close()  # type: ignore[attr-defined]

        restarted, pool2 = await store_for(dsn)
        again, v3 = await restarted.load("global")
        assert v3 == v1 and all(again[a].to_bytes() == before[a].to_bytes() for a in ARMS)

        with pytest.raises(PoisonEvent, match="no routing decision"):
            await restarted.apply_reward("never-routed", "small", 0.5, [])
        await restarted.record_decision("r-2", "global", "small", x)
        with pytest.raises(PoisonEvent, match="outside"):
            await restarted.apply_reward("r-2", "small", 7.5, [])
        with pytest.raises(PoisonEvent, match="outside"):
            await restarted.apply_reward("r-2", "small", float("nan"), [])
        with pytest.raises(PoisonEvent, match="not in the pool"):
            await restarted.apply_reward("r-2", "medium", 0.5, [])
        await restarted.record_decision("r-3", "global", "small", x[:5])
        with pytest.raises(PoisonEvent, match="features"):
            await restarted.apply_reward("r-3", "small", 0.5, [])
        unchanged, v4 = await restarted.load("global")
        assert v4 == v1 and unchanged["small"].to_bytes() == before["small"].to_bytes()
        await pool2.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_corrupt_matrices_are_refused_and_routing_falls_back(dsn: str) -> None:
    async def scenario() -> None:
        store, pool = await store_for(dsn, policy_scope="user", default_arm="large")
        first = await store.decide("t", "corrupt-user", features(1))
        policy_id = first.policy_id
        assert first.version >= 0 and first.scores
        bad = ArmModel.cold(FEATURE_DIM, 1.0)
        bad.A[0, 0] = float("nan")
        async with pool.connection() as conn:  # type: ignore[attr-defined]
            await conn.execute(
                "UPDATE router_arms SET model = %s WHERE policy_id = %s AND arm = 'small'",
                (bad.to_bytes(), policy_id),
            )
        fallback = await store.decide("t", "corrupt-user", features(1))
        assert (fallback.arm, fallback.scores, fallback.version) == ("large", [], -1)
        # The service's path: the policy read with the session's phases, in one round trip, then decided.
        phases, read = await store.read_for_turn("t", "corrupt-user", "t/corrupt-user/s", "turn-x")
        assert phases == [] and read.corrupt is not None and "small" in read.corrupt
        routed = await store.decide("t", "corrupt-user", features(1), policy=read)
        assert (routed.arm, routed.scores, routed.version) == ("large", [], -1)
        await store.record_decision("c-1", policy_id, "small", features(1))
        with pytest.raises(PoisonEvent, match="sanity check"):
            await store.apply_reward("c-1", "small", 0.5, [])
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_session_affinity_penalty_keeps_the_previous_arm(dsn: str) -> None:
    async def scenario() -> None:
        store, pool = await store_for(dsn, policy_scope="user", switch_penalty=100.0)
        x = features(3)
        first = await store.decide("t", "sticky", x, "t/sticky/s1")
        assert first.previous_arm is None and first.switch_penalty == 0.0
        # The session's previous arm was "large": with a huge penalty, every other arm loses.
        await store.record_decision("s-1", first.policy_id, "large", x, "t/sticky/s1")
        second = await store.decide("t", "sticky", x, "t/sticky/s1")
        assert (second.arm, second.previous_arm, second.switch_penalty) == ("large", "large", 100.0)
        other_session = await store.decide("t", "sticky", x, "t/sticky/s2")
        assert other_session.previous_arm is None
        plain, pool2 = await store_for(dsn, policy_scope="user")
        assert (await plain.decide("t", "sticky", x, "t/sticky/s1")).switch_penalty == 0.0
        for p in (pool, pool2):
            await p.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_routing_policy_is_selectable_and_logs_propensity(dsn: str) -> None:
    async def scenario() -> None:
        store, pool = await store_for(dsn, policy_scope="user", routing_policy="eps-greedy", epsilon=0.5)
        props = {(await store.decide("t", "explorer", features(i))).propensity for i in range(30)}
        assert props <= {0.25, 0.75} and props  # eps/n for exploration picks, 1 - eps + eps/n for greedy
        with pytest.raises(ValueError, match="unknown routing policy"):
            await store_for(dsn, routing_policy="psychic")
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_reset_and_tenant_warm_start(dsn: str) -> None:
    async def scenario() -> None:
        tenant_store, pool = await store_for(dsn, policy_scope="tenant")
        x = features(11)
        first = await tenant_store.decide("acme", "anyone", x)
        assert first.policy_id == "tenant:acme"
        await tenant_store.record_decision("w-1", first.policy_id, "large", x)
        await tenant_store.apply_reward("w-1", "large", 0.9, [])
        tenant_models, _ = await tenant_store.load("tenant:acme")

        warm, pool2 = await store_for(dsn, policy_scope="user", warm_start_from_tenant=True)
        new_user = await warm.decide("acme", "newcomer", x)
        models, _ = await warm.load(new_user.policy_id)
        assert models["large"].A.tolist() == tenant_models["large"].A.tolist()  # seeded from the tenant
        assert models["large"].pulls == 0
        cold_user = await warm.decide("other-tenant", "someone", x)
        cold_models, _ = await warm.load(cold_user.policy_id)
        assert cold_models["large"].A.tolist() == np.eye(FEATURE_DIM).tolist()

        await tenant_store.reset("tenant:acme")
        reset_models, version = await tenant_store.load("tenant:acme")
        assert reset_models["large"].A.tolist() == np.eye(FEATURE_DIM).tolist() and version >= 2
        assert (
            await tenant_store.apply_reward("w-1", "large", 0.9, []) is False
        )  # the ledger survives a reset
        for p in (pool, pool2):
            await p.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_query_embedding_policy_has_its_own_policy_and_dimension(dsn: str) -> None:
    from mars.domain.features import QUERY_FEATURE_DIM
    from mars.v1 import events_pb2 as ev

    async def run() -> None:
        store, pool = await store_for(dsn, routing_policy="query-linucb", policy_scope="user")
        assert (store.feature_space, store.dim) == ("query", QUERY_FEATURE_DIM)
        x = store.features(ev.SessionState(), ev.ViewLoad(), 1, list(np.linspace(-1, 1, 384)))
        assert x.shape == (QUERY_FEATURE_DIM,)
        route = await store.decide("acme", "qe-user", x)
        assert route.policy_id == "user:acme/qe-user#query"
        await store.record_decision("qe-1", route.policy_id, route.arm, x)
        assert await store.apply_reward("qe-1", route.arm, 0.7, [])
        models, _ = await store.load(route.policy_id)
        assert models[route.arm].pulls == 1 and models[route.arm].A.shape == (QUERY_FEATURE_DIM,) * 2
        # A state-feature vector is the wrong length for this policy: rejected, never applied.
        await store.record_decision("qe-2", route.policy_id, route.arm, features(1))
        with pytest.raises(PoisonEvent, match="features"):
            await store.apply_reward("qe-2", route.arm, 0.7, [])
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(run())


def test_feedback_correction_shifts_b_once(dsn: str) -> None:
    async def run() -> None:
        store, pool = await store_for(dsn, policy_scope="global")
        await store.load("global")
        x = features(77)
        await store.record_decision("corr-1", "global", "large", x)
        assert await store.apply_reward("corr-1", "large", 0.5, [])
        before, _ = await store.load("global")
        assert await store.apply_correction("corr-1#feedback-1", "corr-1", "large", -0.3)
        assert not await store.apply_correction("corr-1#feedback-1", "corr-1", "large", -0.3)  # replay
        after, _ = await store.load("global")
        np.testing.assert_allclose(after["large"].b, before["large"].b - 0.3 * x)
        np.testing.assert_array_equal(after["large"].A, before["large"].A)
        assert after["large"].pulls == before["large"].pulls
        with pytest.raises(PoisonEvent, match="no routing decision"):
            await store.apply_correction("nope#feedback-1", "nope", "large", 0.1)
        await pool.close()  # type: ignore[attr-defined]

    asyncio.run(run())


def test_frozen_policy_records_rewards_but_never_changes(dsn: str) -> None:
    """MARS_ROUTER_POLICY_UPDATES=false (the no-online-update ablation): judged rewards and corrections are checked
    and recorded in the ledger (applied = false), A, b, pulls and the version stay as they were; the same
    reward moves a learning policy. Turning updates on later does not apply the frozen period's rewards."""
    from mars.v1 import services_pb2 as svc
    from mars_router.service import RouterServicer

    async def scenario() -> None:
        frozen, pool = await store_for(dsn, policy_scope="user", policy_updates=False)
        learning, pool2 = await store_for(dsn, policy_scope="user")
        assert (frozen.updates, learning.updates) == (False, True)
        x = features(21)
        routes = {}
        for name, store in (("frozen", frozen), ("learning", learning)):
            route = await store.decide("t", f"{name}-user", x)
            routes[name] = route
            await store.record_decision(f"fz-{name}", route.policy_id, "small", x)
        before, v0 = await frozen.load(routes["frozen"].policy_id)
        assert await frozen.apply_reward("fz-frozen", "small", 0.8, ["large"]) is True
        assert await frozen.apply_reward("fz-frozen", "small", 0.8, ["large"]) is False  # redelivery
        assert await frozen.apply_correction("fz-frozen#feedback-1", "fz-frozen", "small", -0.2) is True
        with pytest.raises(PoisonEvent, match="outside"):  # the checks still apply while frozen
            await frozen.apply_reward("fz-frozen", "small", 7.5, [])
        after, v1 = await frozen.load(routes["frozen"].policy_id)
        assert v1 == v0
        for arm in ARMS:
            assert after[arm].to_bytes() == before[arm].to_bytes()
            assert (after[arm].pulls, after[arm].reward_sum) == (0, 0.0)
        async with pool.connection() as conn:  # type: ignore[attr-defined]
            cur = await conn.execute(
                "SELECT turn_id, reward, applied FROM router_ledger WHERE turn_id LIKE %s ORDER BY turn_id",
                ("fz-frozen%",),
            )
            assert await cur.fetchall() == [("fz-frozen", 0.8, False), ("fz-frozen#feedback-1", -0.2, False)]

        async def policy_info(store: PolicyStore, user: str) -> svc.PolicyInfo:
            servicer = RouterServicer(store, RouterSettings(policy_scope="user"))
            return await servicer.GetPolicy(svc.PolicyRequest(tenant="t", user_id=user), None)  # type: ignore[arg-type]

        info = await policy_info(frozen, "frozen-user")
        assert info.frozen and info.version == v0

        l_before, l_v0 = await learning.load(routes["learning"].policy_id)
        assert await learning.apply_reward("fz-learning", "small", 0.8, ["large"]) is True
        l_after, l_v1 = await learning.load(routes["learning"].policy_id)
        assert l_v1 > l_v0 and l_after["small"].pulls == 1 and l_after["large"].pulls == 1
        assert not np.array_equal(l_after["small"].b, l_before["small"].b)
        assert not np.array_equal(l_after["small"].A, l_before["small"].A)
        info = await policy_info(learning, "learning-user")
        assert not info.frozen and info.version == l_v1

        # Updates on again over the same tables: the frozen period's reward is a ledger duplicate.
        assert await learning.apply_reward("fz-frozen", "small", 0.8, []) is False
        # ...and a late correction of it moves nothing either: that reward was never applied.
        assert await learning.apply_correction("fz-frozen#feedback-2", "fz-frozen", "small", 0.1) is True
        still, v2 = await learning.load(routes["frozen"].policy_id)
        assert v2 == v0 and still["small"].to_bytes() == before["small"].to_bytes()
        for p in (pool, pool2):
            await p.close()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_seeded_stochastic_policy_routes_the_same_turns_the_same_way(dsn: str) -> None:
    """Item 7: with MARS_ROUTER_ROUTING_SEED, two fresh Thompson policies (two tenants, as two re-drives of one log
    get) that see the same turns (user, seq, features) and the same rewards make the same decisions, through
    the real store: load from Postgres, decide, record, apply the reward, next turn."""
    from mars.domain.bandits import draw_key

    async def drive(tenant: str, seed: int) -> list[str]:
        store, pool = await store_for(dsn, policy_scope="user", routing_policy="thompson", routing_seed=seed)
        arms = []
        for seq in range(1, 21):
            x = features(500 + seq)
            route = await store.decide(tenant, "seeded", x, None, draw_key("seeded", seq))
            await store.record_decision(f"{tenant}-{seq}", route.policy_id, route.arm, x)
            # A deterministic environment: "large" is better, so the policy's means move apart.
            await store.apply_reward(f"{tenant}-{seq}", route.arm, 0.8 if route.arm == "large" else 0.3, [])
            arms.append(route.arm)
        await pool.close()  # type: ignore[attr-defined]
        return arms

    async def scenario() -> None:
        a = await drive("seed-a", 5)
        b = await drive("seed-b", 5)
        assert a == b and set(a) == set(ARMS)  # identical, and the draws did decide something
        assert await drive("seed-c", 6) != a  # another seed, another run

    asyncio.run(scenario())
