"""Canary runs on a real Postgres (issue 47, items 3 and 7), two router replicas without Kafka: a session
stays on one side of the split, each judged turn is added to the run's test once (a redelivered reward adds
nothing) in the reward's transaction, and the first decision is acted on with its audit row, its run row
and a PolicyDecision handed to the producer. The live stack's version is test_policy_canary_stack.py."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

import pytest
from mars.domain.policy_versions import PolicyConfig
from mars.domain.rollout import RolloutState
from mars.v1 import events_pb2 as ev
from mars_router import policy_admin as admin
from test_policy_versions_pg import ARMS, cli, replica, sync_conn, view

pytestmark = pytest.mark.integration
ROLLOUT = {
    "policy_scope": "user",
    "rollout_warmup": 6,
    "rollout_cap": 400,
    "rollout_expected_effect": 0.3,
    "rollout_reward_sd": 0.1,
    "rollout_min_utility": -1.0,
    "policy_config_ttl_s": 0.0,
}


class Producer:
    """Keeps what the stage publishes (the router's producer's send_raw)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None]] = []

    async def send_raw(self, topic: str, payload: bytes, key: bytes | None) -> None:
        self.sent.append((topic, payload, key))


def session_view(tenant: str, session: int, seq: int) -> ev.ViewBuilt:
    event = view(tenant, seq)
    event.turn.session_id = f"s{session}"
    event.turn.user_id = f"u{session % 3}"
    event.turn.turn_id = f"{tenant}-{session}-{seq}"
    return event


def judged(routed: ev.Routed, reward: float, failed: list[str]) -> ev.Judged:
    return ev.Judged(
        turn=routed.turn,
        arm=routed.chosen_arm,
        reward=reward,
        cost_usd=0.001,
        utility=0.8,
        failed_arms=failed,
    )


async def run_turns(
    tenant: str, stages: list[Any], outcome: Any, max_turns: int = 300
) -> dict[str, set[str]]:
    """Turns over 12 sessions, alternating replicas, each judged (and its Judged delivered twice) until the
    run is decided; the sides each session took before the decision."""
    sides: dict[str, set[str]] = defaultdict(set)
    for seq in range(max_turns):
        session = seq % 12
        stage = stages[seq % len(stages)]
        routed = await stage._route(session_view(tenant, session, seq))
        if not routed.rollout_role:
            return sides
        sides[routed.turn.session_id].add(routed.rollout_role)
        assert routed.canary_version == "v2"
        assert routed.config_version == ("v2" if routed.rollout_role == "canary" else "v1")
        event = judged(routed, *outcome(routed))
        await stage.on_judged(event)
        await stages[(seq + 1) % len(stages)].on_judged(event)  # redelivered to the other replica
    raise AssertionError(f"tenant {tenant}: no decision in {max_turns} turns")


def start(dsn: str, tenant: str, live_arms: tuple[str, ...], canary: PolicyConfig) -> None:
    with sync_conn(dsn) as conn:
        admin.create_version(conn, tenant, PolicyConfig("linucb", live_arms, {"alpha": 0.5}), ARMS)
        admin.activate(conn, tenant, "v1")
        admin.create_version(conn, tenant, canary, ARMS)
        admin.set_canary(conn, tenant, "v2", RolloutState().to_dict(), "tests", "e2e")


def test_a_better_canary_is_promoted_and_a_failing_one_rolled_back(postgres: str) -> None:
    async def scenario() -> tuple[dict[str, set[str]], dict[str, set[str]], list[Any]]:
        replicas = [await replica(postgres, **ROLLOUT) for _ in range(2)]  # the schema too
        start(postgres, "cpromote", ("small",), PolicyConfig("linucb", ("large",), {"alpha": 0.5}))
        start(postgres, "crollback", ("small",), PolicyConfig("epsilon_greedy", ARMS, {"epsilon": 1.0}))
        producers = [Producer(), Producer()]
        stages = []
        for (_, stage, _), producer in zip(replicas, producers, strict=True):
            stage._producer = producer  # type: ignore[assignment]
            stages.append(stage)
        # "large" answers better (0.8 vs 0.3): the canary that routes by it wins on reward.
        promoted = await run_turns(
            "cpromote", stages, lambda r: ({"small": 0.3, "large": 0.8}[r.chosen_arm], [])
        )
        # The canary picks "small" or "large" at random; "large" fails (a fallback answers) on every turn.
        rolled = await run_turns(
            "crollback", stages, lambda r: (0.3, ["large"] if r.chosen_arm == "large" else [])
        )
        after = [
            await stages[0]._route(session_view(t, s, 1000 + s))
            for t in ("cpromote", "crollback")
            for s in range(4)
        ]
        for _, _, pool in replicas:
            await pool.close()
        return promoted, rolled, [producers, after]

    promoted, rolled, (producers, after) = asyncio.run(scenario())
    # No session was split between live and canary before the decision, and both sides had sessions.
    for sides in (promoted, rolled):
        assert all(len(s) == 1 for s in sides.values()), sides
        assert {next(iter(s)) for s in sides.values()} == {"live", "canary"}
    with sync_conn(postgres) as conn:
        runs = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT tenant, decision, rule, turns, evidence, published_at IS NOT NULL FROM router_rollouts"
            ).fetchall()
        }
        assert runs["cpromote"][:2] == ("promote", "reward CS above 0")
        assert runs["crollback"][:2] == ("rollback", "failure guardrail")
        for tenant, (_, _, turns, evidence, published) in runs.items():
            # Every judged turn counted once (each was delivered twice).
            ((judged_turns,),) = conn.execute(
                "SELECT count(*) FROM router_ledger l JOIN router_decisions d USING (turn_id) "
                "WHERE d.tenant = %s AND d.canary_version = 'v2'",
                (tenant,),
            ).fetchall()
            assert turns == judged_turns == evidence["turns_live"] + evidence["turns_candidate"]
            assert published
            print(f"{tenant}: decided after {turns} judged turns: {json.dumps(evidence, sort_keys=True)}")
        assert admin.roles(conn, "cpromote") == {"live": "v2"}
        assert admin.roles(conn, "crollback") == {"live": "v1"}
        changes = {t: admin.changes(conn, t, 1)[0] for t in ("cpromote", "crollback")}
        assert (
            changes["cpromote"].action,
            changes["cpromote"].from_version,
            changes["cpromote"].to_version,
        ) == (
            "promote",
            "v1",
            "v2",
        )
        assert changes["crollback"].action == "rollback" and changes["crollback"].role == "canary"
        assert changes["cpromote"].evidence["reason"] == "reward CS above 0"
        assert changes["crollback"].evidence["reason"] == "failure guardrail"
    raw = [(topic, payload, key) for producer in producers for topic, payload, key in producer.sent]
    assert {topic for topic, _, _ in raw} == {"mars.control"}
    sent = [ev.PolicyDecision.FromString(payload) for _, payload, _ in raw]
    assert sorted((e.tenant, e.decision, e.rule) for e in sent) == [
        ("cpromote", "promote", "reward CS above 0"),
        ("crollback", "rollback", "failure guardrail"),
    ]
    # A PolicyDecision read as a UserForgotten (the topic's other readers) names no user.
    assert not any(ev.UserForgotten.FromString(payload).user_id for _, payload, _ in raw)
    # After the decision every session routes by the live version, no split.
    assert [(r.turn.tenant, r.config_version, r.rollout_role) for r in after] == [
        ("cpromote", "v2", "")
    ] * 4 + [("crollback", "v1", "")] * 4


class DownProducer(Producer):
    async def send_raw(self, topic: str, payload: bytes, key: bytes | None) -> None:
        raise ConnectionError("broker away")


def test_a_decision_whose_event_failed_stands_and_is_published_at_the_next_start(postgres: str) -> None:
    async def scenario() -> tuple[list[Any], list[Any], Producer]:
        _, stage, pool = await replica(postgres, **ROLLOUT)
        start(postgres, "cdown", ("small",), PolicyConfig("linucb", ("large",), {"alpha": 0.5}))
        stage._producer = DownProducer()  # type: ignore[assignment]
        await run_turns("cdown", [stage], lambda r: ({"small": 0.3, "large": 0.8}[r.chosen_arm], []))
        with sync_conn(postgres) as conn:
            before = conn.execute(
                "SELECT decision, published_at FROM router_rollouts WHERE tenant = 'cdown'"
            ).fetchall()
        # The next start: a fresh replica publishes what was decided and never published.
        _, restarted, pool_b = await replica(postgres, **ROLLOUT)
        producer = Producer()
        restarted._producer = producer  # type: ignore[assignment]
        await restarted.publish_undelivered()
        await restarted.publish_undelivered()  # published once: marked
        with sync_conn(postgres) as conn:
            after = conn.execute(
                "SELECT decision, published_at IS NOT NULL FROM router_rollouts WHERE tenant = 'cdown'"
            ).fetchall()
        await pool.close()
        await pool_b.close()
        return before, after, producer

    before, after, producer = asyncio.run(scenario())
    assert before == [("promote", None)]  # the decision stands though its event failed
    assert after == [("promote", True)]
    cdown = [ev.PolicyDecision.FromString(p) for _, p, _ in producer.sent]
    assert [(e.tenant, e.decision, e.rule) for e in cdown if e.tenant == "cdown"] == [
        ("cdown", "promote", "reward CS above 0")
    ]


def test_the_canary_command_starts_replaces_shows_and_stops_a_run(postgres: str) -> None:
    async def migrate() -> None:
        _, _, pool = await replica(postgres, **ROLLOUT)
        await pool.close()

    asyncio.run(migrate())
    with sync_conn(postgres) as conn:
        for arms in (("small",), ("large",), ARMS):
            admin.create_version(conn, "ccli", PolicyConfig("linucb", tuple(arms)), ARMS)
        admin.activate(conn, "ccli", "v1")
    started = cli(postgres, "canary", "ccli", "v2", "--reason", "try large")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "canary: canary (none) -> v2" in started.stdout
    replaced = cli(postgres, "canary", "ccli", "v3")
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    refused = cli(postgres, "canary", "ccli", "v1")
    assert (
        refused.returncode == 2
        and "v1 is live for tenant ccli; a canary must be another version" in refused.stdout
    )
    status = cli(postgres, "canary", "ccli", "--status")
    assert status.returncode == 0 and "(open)" in status.stdout and "stopped" in status.stdout, status.stdout
    with sync_conn(postgres) as conn:
        assert admin.roles(conn, "ccli") == {"live": "v1", "canary": "v3"}
        runs = admin.rollouts(conn, "ccli")
        assert [(r.candidate_version, r.decision, r.rule) for r in runs] == [
            ("v3", None, None),
            ("v2", "stopped", "replaced by a canary of v3"),
        ]
    stopped = cli(postgres, "canary", "ccli", "--stop", "--actor", "ops")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    again = cli(postgres, "canary", "ccli", "--stop")
    assert again.returncode == 2 and "tenant ccli has no canary version" in again.stdout
    with sync_conn(postgres) as conn:
        assert admin.roles(conn, "ccli") == {"live": "v1"}
        assert admin.rollouts(conn, "ccli")[0].decision == "stopped"
        assert admin.rollouts(conn, "ccli")[0].rule == "stopped by ops"
        assert [c.action for c in admin.changes(conn, "ccli", 3)] == ["canary", "canary", "canary"]
