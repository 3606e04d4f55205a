"""A shadow policy version on the live stack (issue 47): every service as its own process over Kafka and
Postgres. The operator puts a version in shadow for a tenant; its turns' Routed events carry the shadow's
decision beside the live one, each judged turn is applied once, and the shadow learns exactly its matched
turns."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import yaml
from conftest import ingress_stub, query, read_events, wait_for
from mars.config import TOPIC_ROUTED
from mars.domain.policy_versions import PolicyConfig
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_router import policy_admin as admin
from mars_stack import LocalStack

pytestmark = pytest.mark.integration

TENANT = "shadow-e2e"
USER = "u-shadow"
TEXTS = [
    "Plan a three day trip to Lisbon.",
    "Add a day trip to Sintra.",
    "Make the plan cheaper.",
    "Summarize the final plan.",
]


def test_a_shadow_version_decides_every_turn_beside_the_live_policy(stack: LocalStack) -> None:
    dsn = stack.env["MARS_POSTGRES_DSN"]
    pool_file = (Path(__file__).parent / "models.test.yaml").read_text()
    arms = [m["name"] for m in yaml.safe_load(pool_file)["models"]]  # the stack's pool, its env unneeded
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Uniformly random: its propensity is 1/n on every turn, and it matches the live arm on some.
        config = PolicyConfig("epsilon_greedy", tuple(arms), {"epsilon": 1.0})
        admin.create_version(conn, TENANT, config, arms, note="e2e shadow")
        admin.set_shadow(conn, TENANT, "v1", "tests", "e2e")
    stub = ingress_stub(stack, TENANT)
    replies = [
        stub.SendTurn(
            svc.TurnRequest(
                tenant=TENANT,
                user_id=USER,
                session_id="s1",
                text=text,
                options={"max_tokens": "16", "view_tokens": "192"},
            ),
            timeout=180,
        )
        for text in TEXTS
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
        (f"user:{TENANT}/{USER}#v=v1",),
    )
    print(f"shadowed turns {len(turn_ids)}, matched {matched}, shadow pulls {pulls}")
    assert pulls == matched
