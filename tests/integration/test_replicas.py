"""Two replicas of every service on Apache Kafka. Memory is split by role so the test is exact: memory-1
only applies writes, memory-2 only builds views, so every view comes from a replica that applied none of
the user's writes (its index must follow Postgres). Both ingress replicas take turns for the same users
and each call gets its own reply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import STACK_ENV, ingress_stub, query, read_topic, require_kafka, session_state
from mars.config import TOPIC_VIEW, topic_name
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_stack import LocalStack, StackSettings

pytestmark = [pytest.mark.integration, pytest.mark.resilience]
REPO = Path(__file__).resolve().parents[2]
USERS = ("ana", "ben", "cy")
TURNS = [
    "My ferry to the island leaves from pier 4 at 7:15 every Tuesday",
    "I also have a dentist appointment on Friday afternoon",
    "Please remember I am allergic to peanuts",
    "When does my ferry leave, and from which pier?",
]


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    require_kafka()
    tmp = tmp_path_factory.mktemp("replicas")
    settings = StackSettings(
        workdir=tmp / "stack",
        model_pool=REPO / "config" / "models.standin.yaml",
        llm="standin",
        broker="kafka",
        replicas=2,
        partitions=4,
        extra_env=dict(STACK_ENV),
        service_env={"memory-1": {"MARS_MEMORY_ROLES": "writer"}, "memory-2": {"MARS_MEMORY_ROLES": "views"}},
    )
    stack = LocalStack(settings).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_views_from_a_replica_that_applied_none_of_the_writes(replicated: LocalStack) -> None:
    stubs = [ingress_stub(replicated, "rep", addr=a) for a in replicated.addrs("ingress")]
    assert len(stubs) == 2
    replies: dict[str, list[svc.TurnReply]] = {u: [] for u in USERS}
    for n, text in enumerate(TURNS):
        for k, user in enumerate(USERS):
            stub = stubs[(n + k) % 2]  # a user's turns alternate between the two ingress replicas
            reply = stub.SendTurn(svc.TurnRequest(tenant="rep", user_id=user, text=text), timeout=60)
            assert reply.seq == n + 1 and reply.text
            replies[user].append(reply)

    # Every view waited for and found the user's previous turn (read-your-writes across replicas).
    views = [
        ev.ViewBuilt.FromString(r.value)
        for r in read_topic(replicated.env["MARS_KAFKA_BOOTSTRAP"], topic_name(TOPIC_VIEW))
    ]
    ours = [v for v in views if v.turn.tenant == "rep"]
    assert len({v.turn.turn_id for v in ours}) == len(USERS) * len(TURNS)
    assert not [v.turn.turn_id for v in ours if v.view.possibly_stale]

    # memory-2 wrote nothing; its index of every user equals the records memory-1 stored.
    with replicated.channel("memory-2") as channel:
        memory = svc_grpc.MemoryStub(channel)
        for user in USERS:
            rows = query(
                replicated,
                "SELECT record_id, turn_id FROM memory_records WHERE tenant = 'rep' AND user_id = %s "
                "ORDER BY commit_no",
                (user,),
            )
            assert [t for _, t in rows] == [r.turn_id for r in replies[user]]
            described = memory.DescribeIndex(svc.DescribeIndexRequest(tenant="rep", user_id=user), timeout=30)
            assert described.replica == "memory-2"
            assert list(described.record_ids) == [r for r, _ in rows]
            assert described.lexical_docs == len(rows) and described.dense_vectors >= len(rows)
            # A view built there now finds the ferry turn, which memory-1 applied.
            view = memory.BuildView(
                svc.BuildViewRequest(
                    tenant="rep", user_id=user, text="ferry pier time", state=session_state()
                ),
                timeout=30,
            )
            assert replies[user][0].turn_id in {b.source_turn_id for b in view.blocks}


def test_every_turn_recorded_answered_once(replicated: LocalStack) -> None:
    from conftest import wait_for

    def statuses() -> dict[str, int]:
        rows = query(
            replicated, "SELECT status, count(*) FROM ingress_turns WHERE tenant = 'rep' GROUP BY status"
        )
        return {str(k): int(v) for k, v in rows}

    # The outcome group records ANSWERED from the generated event, shortly after the reply.
    wait_for(lambda: statuses().get("PENDING", 0) == 0, 30, "every answered turn to be recorded")
    assert statuses() == {"ANSWERED": len(USERS) * len(TURNS)}
    dup = query(
        replicated, "SELECT count(*) - count(DISTINCT turn_id) FROM memory_records WHERE tenant = 'rep'"
    )
    assert dup[0][0] == 0


def test_a_turn_whose_replica_died_before_publishing_is_sent_from_the_outbox(replicated: LocalStack) -> None:
    """Accepted (recorded PENDING with its event) but never published, as when an ingress replica dies
    between the two: a sweep publishes it again and the pipeline answers it."""
    import time as _time
    import uuid

    from conftest import wait_for

    turn_id = uuid.uuid4().hex
    now_ms = int(_time.time() * 1000)
    envelope = ev.TurnEnvelope(
        turn_id=turn_id,
        tenant="rep",
        user_id="orphan",
        session_id="default",
        seq=1,
        received_at_ms=now_ms,
        schema_version=1,
        deadline_ms=now_ms + 90_000,
    )
    keys = replicated.keyring()  # the ingress names the user's data key before it stores the outbox copy
    if keys is not None:
        envelope.data_key_id = keys.for_user("rep", "orphan")
    received = ev.TurnReceived(turn=envelope, text="a question nobody published")
    query(
        replicated,
        "INSERT INTO ingress_turns (turn_id, tenant, user_id, session_id, seq, status, created_at, deadline_at, "
        "received) VALUES (%s, 'rep', 'orphan', 'default', 1, 'PENDING', now() - interval '20 seconds', "
        "now() + interval '80 seconds', %s) RETURNING turn_id",
        (turn_id, received.SerializeToString()),
    )
    query(replicated, "INSERT INTO ingress_user_seq VALUES ('rep', 'orphan', 1) RETURNING last_seq")

    def status() -> str:
        return str(query(replicated, "SELECT status FROM ingress_turns WHERE turn_id = %s", (turn_id,))[0][0])

    wait_for(lambda: status() != "PENDING", 60, "the orphaned turn to be answered")
    assert status() == "ANSWERED"
    row = query(
        replicated,
        "SELECT republished_at IS NOT NULL, received IS NULL FROM ingress_turns WHERE turn_id = %s",
        (turn_id,),
    )
    assert row == [(True, True)]


def test_an_orphan_past_its_deadline_times_out_without_its_plaintext_copy(replicated: LocalStack) -> None:
    """The outbox copy holds the turn's text in the clear: a turn that times out keeps none of it."""
    import uuid

    from conftest import wait_for

    turn_id = uuid.uuid4().hex
    received = ev.TurnReceived(turn=ev.TurnEnvelope(turn_id=turn_id, tenant="rep", user_id="late"), text="secret")
    query(
        replicated,
        "INSERT INTO ingress_turns (turn_id, tenant, user_id, session_id, seq, status, created_at, deadline_at, "
        "received) VALUES (%s, 'rep', 'late', 'default', 1, 'PENDING', now() - interval '10 minutes', "
        "now() - interval '5 minutes', %s) RETURNING turn_id",
        (turn_id, received.SerializeToString()),
    )

    def row() -> tuple[str, bool]:
        found = query(replicated, "SELECT status, received IS NULL FROM ingress_turns WHERE turn_id = %s", (turn_id,))
        return str(found[0][0]), bool(found[0][1])

    wait_for(lambda: row()[0] == "TIMEOUT", 30, "the orphan's timeout")
    assert row() == ("TIMEOUT", True)
