"""Canary runs on the live stack (issue 47, "Done when"): every service its own process over Kafka and
Postgres, the stand-in LLM answering. Tenant A's canary prefers the cheap arm where its live version uses
the dear one (its judge weighs cost heavily): the sequential test promotes it (the reward CS, not a
guardrail). Tenant B's canary picks the broken endpoint half the time: the failure guardrail rolls it back.
Each decision is a PolicyDecision on mars.control, a router_rollouts row and an audit row; every judged turn
is applied once; no session changes side before the decision; after it, every session routes by the live
version within the roles' TTL. A third tenant runs a shadow only, on the same stack."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from conftest import ingress_stub, query, read_events, read_topic, start_stack, wait_for
from mars.config import TOPIC_CONTROL, TOPIC_DEAD_LETTER, TOPIC_JUDGED, TOPIC_ROUTED
from mars.domain.policy_versions import PolicyConfig
from mars.domain.rollout import RolloutState
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_router import policy_admin as admin
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

POOL = "models.standin-test.yaml"
A, B = "canary-a", "canary-b"
SESSIONS = 12
TTL_S = 0.5
#: Small enough that a run decides in a few dozen turns: four judged turns per side before any decision,
#: the test tuned for a large effect, the utility guardrail off (the stand-in's answers are not graded).
ROUTER_ENV = {
    "MARS_ROUTER_ROLLOUT_WARMUP": "4",
    "MARS_ROUTER_ROLLOUT_CAP": "400",
    "MARS_ROUTER_ROLLOUT_EXPECTED_EFFECT": "0.2",
    "MARS_ROUTER_ROLLOUT_REWARD_SD": "0.1",
    "MARS_ROUTER_ROLLOUT_MIN_UTILITY": "-1",
    "MARS_ROUTER_POLICY_CONFIG_TTL_S": str(TTL_S),
}
#: Tenant A's judge prices cost high: the dear arm's reward is clearly lower than the cheap arm's.
JUDGE_ENV = {"MARS_JUDGE_LAMBDA_TENANTS": json.dumps({A: 3000.0})}


@pytest.fixture(scope="module")
def canary_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(
        tmp_path_factory.mktemp("canary"),
        POOL,
        llm="standin",
        service_env={"router": ROUTER_ENV, "judge": JUDGE_ENV},
    )
    try:
        yield s
    finally:
        s.stop()


def start_runs(dsn: str) -> None:
    arms = [m["name"] for m in yaml.safe_load((Path(__file__).parent / POOL).read_text())["models"]]
    broken, short, long = arms
    with psycopg.connect(dsn, autocommit=True) as conn:
        for tenant, live, canary in (
            (A, PolicyConfig("linucb", (long,)), PolicyConfig("linucb", (short,))),
            (
                B,
                PolicyConfig("linucb", (short,)),
                PolicyConfig("epsilon_greedy", (broken, short), {"epsilon": 1.0}),
            ),
        ):
            admin.create_version(conn, tenant, live, arms, note="e2e live")
            admin.activate(conn, tenant, "v1", "tests")
            admin.create_version(conn, tenant, canary, arms, note="e2e canary")
            admin.set_canary(conn, tenant, "v2", RolloutState().to_dict(), "tests", "e2e")
        # B runs a shadow too (uniformly random over the working arms): it decides beside whichever version
        # routes the turn, never answering.
        admin.create_version(conn, B, PolicyConfig("epsilon_greedy", (short, long), {"epsilon": 1.0}), arms)
        admin.set_shadow(conn, B, "v3", "tests", "e2e")


def decided(stack: LocalStack, tenant: str) -> bool:
    rows = query(stack, "SELECT decided_at IS NOT NULL FROM router_rollouts WHERE tenant = %s", (tenant,))
    return bool(rows) and all(r[0] for r in rows)


def session_turns(stack: LocalStack, tenant: str, session: int, stop: Any) -> list[tuple[str, list[str]]]:
    """A session's turns, one after another, until its tenant's run is decided (or 20 turns): each turn's
    id and the arms its attempts went to, in order."""
    stub = ingress_stub(stack, tenant)
    turn_ids = []
    for i in range(20):
        if stop():
            break
        reply = stub.SendTurn(
            svc.TurnRequest(
                tenant=tenant,
                user_id=f"u{session % 4}",
                session_id=f"s{session}",
                text=f"Step {i}: plan the next part of the trip, briefly.",
                options={"max_tokens": "16", "view_tokens": "192"},
            ),
            timeout=120,
        )
        turn_ids.append((reply.turn_id, [a.arm for a in reply.attempts]))
    return turn_ids


def test_canary_runs_are_promoted_and_rolled_back_on_the_live_stack(canary_stack: LocalStack) -> None:
    stack = canary_stack
    start_runs(stack.env["MARS_POSTGRES_DSN"])
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {
            (t, s): pool.submit(session_turns, stack, t, s, lambda t=t: decided(stack, t))
            for t in (A, B)
            for s in range(SESSIONS)
        }
        turns = {key: f.result() for key, f in futures.items()}
    elapsed = time.monotonic() - started
    attempts = {t: arms for ids in turns.values() for t, arms in ids}
    all_turns = list(attempts)
    wait_for(lambda: decided(stack, A) and decided(stack, B), 90, "both canary runs to decide")
    judged_ids = {
        e.turn.turn_id: e
        for e in read_events(stack, TOPIC_JUDGED, ev.Judged)
        if e.turn.turn_id in set(all_turns)
    }
    wait_for(
        lambda: (
            query(stack, "SELECT count(*) FROM router_ledger WHERE turn_id = ANY(%s)", (all_turns,))[0][0]
            >= len(judged_ids)
        ),
        60,
        "every judged turn at the router",
    )
    judged_ids = {
        e.turn.turn_id: e
        for e in read_events(stack, TOPIC_JUDGED, ev.Judged)
        if e.turn.turn_id in set(all_turns)
    }
    routed = {
        e.turn.turn_id: e
        for e in read_events(stack, TOPIC_ROUTED, ev.Routed)
        if e.turn.turn_id in set(all_turns)
    }

    runs = {
        r[0]: r[1:]
        for r in query(
            stack,
            "SELECT tenant, decision, rule, turns, evidence, published_at IS NOT NULL, rollout_id FROM router_rollouts",
        )
    }
    print(f"{len(all_turns)} turns in {elapsed:.1f} s; {len(judged_ids)} judged")
    for tenant, (decision, rule, n, evidence, _, _) in runs.items():
        print(f"{tenant}: {decision} ({rule}) after {n} judged turns: {json.dumps(evidence, sort_keys=True)}")
    # (a) and (b): the stopping rule promoted A's canary; the failure guardrail rolled B's back.
    assert runs[A][:2] == ("promote", "reward CS above 0")
    assert runs[B][:2] == ("rollback", "failure guardrail")
    for tenant in (A, B):
        _, _, n, evidence, published, _ = runs[tenant]
        assert published and n == evidence["turns_live"] + evidence["turns_candidate"]
        assert min(evidence["turns_live"], evidence["turns_candidate"]) >= 4
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"], autocommit=True) as conn:
        assert admin.roles(conn, A) == {"live": "v2"} and admin.roles(conn, B) == {
            "live": "v1",
            "shadow": "v3",
        }
        change_a, change_b = admin.changes(conn, A, 1)[0], admin.changes(conn, B, 1)[0]
    assert (change_a.action, change_a.role, change_a.from_version, change_a.to_version) == (
        "promote",
        "canary",
        "v1",
        "v2",
    )
    assert (change_b.action, change_b.role, change_b.from_version) == ("rollback", "canary", "v2")
    assert change_a.evidence["reason"] == runs[A][1] and change_b.evidence["reason"] == runs[B][1]
    assert change_a.actor == change_b.actor == "router"
    decisions = [
        ev.PolicyDecision.FromString(r.value)
        for r in read_topic(stack.env["MARS_KAFKA_BOOTSTRAP"], TOPIC_CONTROL)
        if ev.PolicyDecision.FromString(r.value).tenant in (A, B)
    ]
    assert sorted((d.tenant, d.decision, d.rule, d.candidate_version, d.live_version) for d in decisions) == [
        (A, "promote", "reward CS above 0", "v2", "v1"),
        (B, "rollback", "failure guardrail", "v2", "v1"),
    ]
    # The topic's other readers (every service's forget reader) took them for no forget: none dead-lettered.
    letters = [
        ev.DeadLetter.FromString(r.value)
        for r in read_topic(stack.env["MARS_KAFKA_BOOTSTRAP"], TOPIC_DEAD_LETTER)
    ]
    assert not [d for d in letters if d.source_topic == TOPIC_CONTROL]
    for d in decisions:
        assert (
            json.loads(d.evidence_json)["decision"] == d.decision
            and d.turns_live + d.turns_candidate == runs[d.tenant][2]
        )

    # (c) every judged turn applied once; each version's matrices pulled once per judged turn it decided
    # (and once more per failed arm of the turn, which learns zero utility).
    ledger = query(
        stack,
        "SELECT count(*), count(DISTINCT turn_id) FROM router_ledger WHERE turn_id = ANY(%s)",
        (all_turns,),
    )
    assert ledger == [(len(judged_ids), len(judged_ids))]
    expected: dict[tuple[str, str], int] = defaultdict(int)
    for turn_id, j in judged_ids.items():
        expected[j.turn.tenant, routed[turn_id].config_version] += 1 + len(set(j.failed_arms) - {j.arm})
    for (tenant, version), pulls in expected.items():
        ((found,),) = query(
            stack,
            "SELECT coalesce(sum(pulls), 0) FROM router_arms WHERE policy_id LIKE %s",
            (f"user:{tenant}/%#v={version}",),
        )
        assert found == pulls, (tenant, version)
    # The shadow: on every routed event of B, never the answer (each turn's first attempt is the arm of the
    # version that decided); it learned exactly its matched judged turns (its arm's reward was observed).
    for turn_id, e in routed.items():
        assert attempts[turn_id][0] == e.chosen_arm
        assert e.shadow_version == ("v3" if e.turn.tenant == B else "")
    matched = sum(routed[t].shadow_arm in attempts[t] for t, j in judged_ids.items() if j.turn.tenant == B)
    ((shadow_pulls,),) = query(
        stack,
        "SELECT coalesce(sum(pulls), 0) FROM router_arms WHERE policy_id LIKE %s",
        (f"user:{B}/%#v=v3",),
    )
    print(f"{B}'s shadow: {matched} matched judged turns, {shadow_pulls} pulls")
    assert 0 < shadow_pulls == matched
    # (d) no session split before the decision: each session's canary-run turns all took one side.
    sides: dict[tuple[str, str], set[str]] = defaultdict(set)
    for e in routed.values():
        if e.rollout_role:
            sides[e.turn.tenant, e.turn.session_id].add(e.rollout_role)
            assert e.config_version == ("v2" if e.rollout_role == "canary" else "v1")
    assert sides and all(len(s) == 1 for s in sides.values()), sides
    for tenant in (A, B):
        assert {next(iter(s)) for (t, _), s in sides.items() if t == tenant} == {"live", "canary"}
    # After the decision (and the TTL), every session routes by the live version.
    time.sleep(2 * TTL_S)
    after = {}
    for tenant in (A, B):
        stub = ingress_stub(stack, tenant)
        for s in range(4):
            reply = stub.SendTurn(
                svc.TurnRequest(
                    tenant=tenant,
                    user_id="u0",
                    session_id=f"s{s}",
                    text="And now?",
                    options={"max_tokens": "8"},
                ),
                timeout=120,
            )
            after[reply.turn_id] = tenant
    wait_for(
        lambda: (
            len([e for e in read_events(stack, TOPIC_ROUTED, ev.Routed) if e.turn.turn_id in after])
            == len(after)
        ),
        30,
        "the turns after the decisions to be routed",
    )
    late = [e for e in read_events(stack, TOPIC_ROUTED, ev.Routed) if e.turn.turn_id in after]
    assert sorted((e.turn.tenant, e.config_version, e.rollout_role) for e in late) == sorted(
        [(A, "v2", "")] * 4 + [(B, "v1", "")] * 4
    )


SHADOW_TENANT = "shadow-e2e"
SHADOW_USER = "u-shadow"
SHADOW_TEXTS = [
    "Plan a three day trip to Lisbon.",
    "Add a day trip to Sintra.",
    "Make the plan cheaper.",
    "Summarize the final plan.",
]


def test_a_shadow_version_decides_every_turn_beside_the_live_policy(canary_stack: LocalStack) -> None:
    """A tenant with a shadow and no canary (its own tenant on the canary run's stack): every turn's Routed
    event carries the shadow's decision beside the live one, each judged turn is applied once, and the shadow
    learns exactly its matched turns."""
    stack = canary_stack
    dsn = stack.env["MARS_POSTGRES_DSN"]
    pool_file = (Path(__file__).parent / POOL).read_text()
    arms = [m["name"] for m in yaml.safe_load(pool_file)["models"]]  # the stack's pool, its env unneeded
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Uniformly random: its propensity is 1/n on every turn, and it matches the live arm on some.
        config = PolicyConfig("epsilon_greedy", tuple(arms), {"epsilon": 1.0})
        admin.create_version(conn, SHADOW_TENANT, config, arms, note="e2e shadow")
        admin.set_shadow(conn, SHADOW_TENANT, "v1", "tests", "e2e")
    stub = ingress_stub(stack, SHADOW_TENANT)
    replies = [
        stub.SendTurn(
            svc.TurnRequest(
                tenant=SHADOW_TENANT,
                user_id=SHADOW_USER,
                session_id="s1",
                text=text,
                options={"max_tokens": "16", "view_tokens": "192"},
            ),
            timeout=180,
        )
        for text in SHADOW_TEXTS
    ]
    turn_ids = [r.turn_id for r in replies]
    wait_for(
        lambda: (
            query(stack, "SELECT count(*) FROM router_ledger WHERE turn_id = ANY(%s)", (turn_ids,))[0][0]
            == len(turn_ids)
        ),
        what="router updates for the shadowed turns",
    )
    routed = {
        e.turn.turn_id: e for e in read_events(stack, TOPIC_ROUTED, ev.Routed) if e.turn.turn_id in turn_ids
    }
    assert set(routed) == set(turn_ids)
    for reply in replies:
        event = routed[reply.turn_id]
        assert (event.config_version, event.shadow_version) == ("default", "v1")
        assert event.shadow_arm in arms and event.shadow_propensity == pytest.approx(1 / len(arms))
        # The answer is the live policy's: its first attempt is the live choice, never the shadow's.
        assert reply.attempts[0].arm == event.chosen_arm
    rows = query(
        stack,
        "SELECT turn_id, version, arm FROM router_shadow_decisions WHERE turn_id = ANY(%s) ORDER BY turn_id",
        (turn_ids,),
    )
    assert {(t, v, a) for t, v, a in rows} == {(t, "v1", routed[t].shadow_arm) for t in turn_ids}
    assert query(
        stack,
        "SELECT count(*), count(DISTINCT turn_id) FROM router_ledger WHERE turn_id = ANY(%s)",
        (turn_ids,),
    ) == [(len(turn_ids), len(turn_ids))]
    # Matched: the shadow's arm is one whose reward the turn observed (the answer's, or a failed attempt's).
    matched = sum(routed[r.turn_id].shadow_arm in {a.arm for a in r.attempts} for r in replies)
    ((pulls,),) = query(
        stack,
        "SELECT coalesce(sum(pulls), 0) FROM router_arms WHERE policy_id = %s",
        (f"user:{SHADOW_TENANT}/{SHADOW_USER}#v=v1",),
    )
    print(f"shadowed turns {len(turn_ids)}, matched {matched}, shadow pulls {pulls}")
    assert pulls == matched
