"""A user's data over the real stack (two memory replicas): recorded history imported (Ingress.ImportHistory:
idempotent, per user, stored by the memory writer, never judged), and forgotten. After Ingress.ForgetUser (an
admin key of the tenant) no table holds a row of the user (checked over information_schema, so a new table with a user
column is covered without editing this test), no memory replica's index holds a vector of them (both had
loaded it: the UserForgotten control event must evict it), the other users of the tenant and the same user
id in another tenant are untouched, a non-admin key is refused, and the user can start afresh."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from conftest import (
    REPO,
    STACK_ENV,
    api_key,
    ingress_stub,
    query,
    read_events,
    read_topic,
    session_state,
    wait_for,
)
from google.protobuf.message import Message
from mars import data_keys, forget
from mars.auth import mint_key
from mars.bus.codec import TOPIC_EVENTS
from mars.config import ALL_TOPICS, TOPIC_GENERATED, TOPIC_VIEW
from mars.identity import with_identity
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress import budget_store
from mars_ingress.budget_store import Target
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack, StackSettings
from mars_tools.replay.readers import read_topics
from mars_tools.replay.traces import RawRecord, TraceBuilder, summarize

pytestmark = pytest.mark.integration

TENANT, OTHER_TENANT = "fgt", "fgt2"
GONE, KEPT = "gone", "kept"
TURNS = [
    "My ferry to the island leaves from pier 4 at 7:15 every Tuesday",
    "Please remember I am allergic to peanuts",
    "When does my ferry leave, and from which pier?",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("forget")
    settings = StackSettings(
        workdir=tmp / "stack",
        model_pool=REPO / "config" / "models.standin.yaml",
        llm="standin",
        replicas_of={"memory": 2},
        # ForgetUser waits this long for every owner's acknowledgement (a stopped judge, below).
        extra_env={**STACK_ENV, "MARS_INGRESS_FORGET_WAIT_S": "5"},
    )
    s = LocalStack(settings).start()
    try:
        yield s
    finally:
        s.stop()


def _user_columns(stack: LocalStack) -> list[tuple[str, str]]:
    rows = query(
        stack,
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND column_name = ANY(%s)",
        (list(forget.USER_COLUMNS),),
    )
    return [(str(t), str(c)) for t, c in rows]


def rows_of(stack: LocalStack, tenant: str, user: str, turn_ids: list[str]) -> dict[str, int]:
    """Rows of (tenant, user) in every table with a per-user column, found through information_schema."""
    by_table: dict[str, set[str]] = {}
    for table, column in _user_columns(stack):
        by_table.setdefault(table, set()).add(column)
    counts: dict[str, int] = {}
    for table, columns in sorted(by_table.items()):
        preds, params = [], []
        if "user_id" in columns:
            preds.append("(tenant = %s AND user_id = %s)")
            params += [tenant, user]
        if "turn_id" in columns:  # router_ledger's feedback corrections: "<turn_id>#feedback-N"
            preds.append("split_part(turn_id, '#', 1) = ANY(%s)")
            params.append(turn_ids)
        if "session_key" in columns:
            preds.append("starts_with(session_key, %s)")
            params.append(f"{tenant}/{user}/")
        if "policy_id" in columns:
            preds.append("starts_with(policy_id, %s)")
            params.append(forget.user_policy_id(tenant, user))
        sql = f"SELECT count(*) FROM {table} WHERE " + " OR ".join(preds)
        counts[table] = int(query(stack, sql, tuple(params))[0][0])
    return counts


#: Words of TURNS: with events sealed they appear in no record of any topic, whoever's turn it was.
SECRETS = (b"pier 4", b"peanuts", b"ferry")


def every_record(stack: LocalStack) -> list[RawRecord]:
    """Every record of every topic of the stack (dead letters and control events included)."""

    async def read() -> list[RawRecord]:
        bootstrap = stack.env["MARS_KAFKA_BOOTSTRAP"]
        kafka = stack.kafka_options()
        return [r async for r in read_topics(bootstrap, ALL_TOPICS, idle_s=1.5, kafka=kafka)]

    return asyncio.run(read())


def events_of(records: list[RawRecord], tenant: str, user: str) -> list[Message]:
    out = []
    for r in records:
        if (cls := TOPIC_EVENTS.get(r.topic)) is not None:
            event = cls.FromString(r.value)
            if (event.turn.tenant, event.turn.user_id) == (tenant, user):  # type: ignore[attr-defined]
                out.append(event)
    return out


def keyring(stack: LocalStack) -> data_keys.SyncKeyring:
    """A fresh keyring (nothing cached) as a tool opens it: the stack's master key and Postgres."""
    master = data_keys.sealing.parse_master_key(Path(stack.env["MARS_MASTER_KEY_FILE"]).read_text())
    return data_keys.SyncKeyring(psycopg.connect(stack.env["MARS_POSTGRES_DSN"], autocommit=True), master)


def describe_all(stack: LocalStack, tenant: str, user: str) -> list[svc.IndexDescription]:
    out = []
    for addr in stack.addrs("memory"):
        with grpc.insecure_channel(addr) as plain:
            out.append(
                svc_grpc.MemoryStub(with_identity(plain, stack.caller())).DescribeIndex(
                    svc.DescribeIndexRequest(tenant=tenant, user_id=user), timeout=30
                )
            )
    return out


def admin_stub(stack: LocalStack, tenant: str) -> svc_grpc.IngressStub:
    key = mint_key(stack.env["MARS_POSTGRES_DSN"], tenant, admin=True, label="forget test").key
    return svc_grpc.IngressStub(ingress_channel(stack.addr("ingress"), key))


def _settled(stack: LocalStack, turn_ids: list[str]) -> bool:
    """Every turn answered, stored in memory, judged and its reward applied: nothing more to write."""
    n = len(turn_ids)
    checks = (
        "SELECT count(*) FROM ingress_turns WHERE status = 'ANSWERED' AND turn_id = ANY(%s)",
        "SELECT count(*) FROM memory_records WHERE turn_id = ANY(%s)",
        "SELECT count(*) FROM judge_rewards WHERE turn_id = ANY(%s)",
        "SELECT count(*) FROM router_ledger WHERE turn_id = ANY(%s)",
    )
    return all(int(query(stack, sql, (turn_ids,))[0][0]) == n for sql in checks)


def test_forget_user(stack: LocalStack) -> None:
    assert len(stack.addrs("memory")) == 2
    # Every table with a per-user column in the running schema is one mars.forget deletes from.
    assert forget.uncovered(_user_columns(stack)) == []

    people = [(TENANT, GONE), (TENANT, KEPT), (OTHER_TENANT, GONE)]
    turn_ids: dict[tuple[str, str], list[str]] = {p: [] for p in people}
    for tenant, user in people:
        stub = ingress_stub(stack, tenant)
        for text in TURNS:
            reply = stub.SendTurn(svc.TurnRequest(user_id=user, session_id="s", text=text), timeout=60)
            turn_ids[tenant, user].append(reply.turn_id)
        stub.SubmitFeedback(
            svc.FeedbackRequest(user_id=user, turn_id=turn_ids[tenant, user][0], thumbs=1), timeout=30
        )
    # A key limited to the user, which goes with them, and budgets: the user's and their key's go, the
    # other user's and the same user id's in another tenant stay.
    gone_key_id = api_key(stack, TENANT, GONE)[5:13]
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"], autocommit=True) as conn:
        for target in (
            Target(TENANT, GONE),
            Target(TENANT, key_id=gone_key_id),
            Target(TENANT, KEPT),
            Target(OTHER_TENANT, GONE),
        ):
            budget_store.set_budget(conn, target, 100.0, None)
    everything = [t for ids in turn_ids.values() for t in ids]
    wait_for(lambda: _settled(stack, everything), 90, "every turn stored, judged and applied")
    wait_for(
        lambda: all(rows_of(stack, t, u, turn_ids[t, u])["judge_feedback"] == 1 for t, u in people),
        60,
        "feedback recorded",
    )

    def corrections_applied() -> bool:
        firsts = [ids[0] for ids in turn_ids.values()]
        made = query(
            stack,
            "SELECT coalesce(sum(corrections), 0) FROM judge_rewards WHERE turn_id = ANY(%s)",
            (firsts,),
        )
        ledgered = query(
            stack,
            "SELECT count(*) FROM router_ledger WHERE split_part(turn_id, '#', 1) = ANY(%s) AND turn_id LIKE '%%#%%'",
            (firsts,),
        )
        return int(made[0][0]) == int(ledgered[0][0])

    wait_for(corrections_applied, 60, "feedback corrections (if any) applied by the router")

    before = {p: rows_of(stack, *p, turn_ids[p]) for p in people}
    for table in ("ingress_turns", "memory_records", "judge_rewards", "router_decisions", "router_arms"):
        assert before[TENANT, GONE][table] > 0, table
    assert before[TENANT, GONE]["ingress_api_keys"] == 1
    assert before[TENANT, GONE]["ingress_budgets"] == 1  # the key's budget names no user (found by its key)
    # Both replicas load the user's index (before the forget: only the control event can empty them).
    for described in describe_all(stack, TENANT, GONE):
        assert described.lexical_docs == len(TURNS) and described.dense_vectors >= len(TURNS)
    kept_index = {d.replica: list(d.record_ids) for d in describe_all(stack, TENANT, KEPT)}

    # On the topics: every user's text sealed (no plaintext anywhere), and it opens with the user's key.
    records = every_record(stack)
    assert not [r for r in records for word in SECRETS if word in r.value]
    sealed = [e for e in events_of(records, TENANT, GONE) if data_keys.is_sealed(e)]
    assert {type(e) for e in sealed} >= {ev.TurnReceived, ev.ViewBuilt, ev.Generated, ev.Feedback}
    keys = keyring(stack)
    for event in sealed:
        keys.unseal(event)
    assert sorted(e.text for e in sealed if isinstance(e, ev.TurnReceived)) == sorted(TURNS)
    assert all(e.turn.data_key_id for e in events_of(records, TENANT, GONE))  # type: ignore[attr-defined]

    # Who may: not without a key, not a plain key, not a user's key, not another tenant's admin key.
    request = svc.ForgetUserRequest(user_id=GONE)
    no_key = svc_grpc.IngressStub(grpc.insecure_channel(stack.addr("ingress")))
    for stub, code in (
        (no_key, grpc.StatusCode.UNAUTHENTICATED),
        (ingress_stub(stack, TENANT), grpc.StatusCode.PERMISSION_DENIED),
        (ingress_stub(stack, TENANT, GONE), grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.ForgetUser(request, timeout=30)
        assert info.value.code() == code
    with pytest.raises(grpc.RpcError) as info:
        admin_stub(stack, OTHER_TENANT).ForgetUser(
            svc.ForgetUserRequest(tenant=TENANT, user_id=GONE), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert rows_of(stack, TENANT, GONE, turn_ids[TENANT, GONE]) == before[TENANT, GONE]

    reply = admin_stub(stack, TENANT).ForgetUser(request, timeout=60)
    assert reply.forget_id
    # Each service deleted its own rows (as its own Postgres role) and acknowledged before the reply.
    assert list(reply.not_acknowledged) == []
    acked = query(stack, f"SELECT service FROM {forget.FORGET_ACKS} WHERE forget_id = %s", (reply.forget_id,))
    assert sorted(str(r[0]) for r in acked) == sorted(forget.acknowledgers())
    assert reply.rows_deleted["ingress_turns"] == len(TURNS)
    assert reply.rows_deleted["memory_records"] == len(TURNS)
    assert reply.rows_deleted["ingress_api_keys"] == 1
    assert reply.rows_deleted["ingress_budgets"] == 2
    assert sum(reply.rows_deleted.values()) == sum(before[TENANT, GONE].values()) + 1  # + the key's budget
    assert query(stack, "SELECT count(*) FROM ingress_budgets WHERE key_id = %s", (gone_key_id,)) == [(0,)]

    # 0 rows of the user in any table; 0 vectors in every replica's index.
    assert set(rows_of(stack, TENANT, GONE, turn_ids[TENANT, GONE]).values()) == {0}

    def evicted() -> bool:
        return all(
            d.dense_vectors == 0 and d.lexical_docs == 0 and not d.record_ids
            for d in describe_all(stack, TENANT, GONE)
        )

    wait_for(evicted, 30, "every memory replica to drop the forgotten user's index")

    # Crypto-shredded: the user's data key is gone, so none of their text on any topic opens any more;
    # everyone else's still does, and replay reports the user's turns as forgotten.
    after = every_record(stack)
    assert not [r for r in after for word in SECRETS if word in r.value]
    keys = keyring(stack)
    gone_events = events_of(after, TENANT, GONE)
    assert len(gone_events) >= len(sealed)
    for event in gone_events:
        assert keys.key(event.turn.data_key_id) is None  # type: ignore[attr-defined]
        if data_keys.is_sealed(event):
            with pytest.raises(data_keys.Forgotten):
                keys.unseal(event)
    for p in ((TENANT, KEPT), (OTHER_TENANT, GONE)):
        received = [e for e in events_of(after, *p) if isinstance(e, ev.TurnReceived)]
        for event in received:
            keys.unseal(event)
        assert sorted(e.text for e in received) == sorted(TURNS), p
    builder = TraceBuilder(keys)
    for r in after:
        builder.add(r)
    assert builder.forgotten == set(turn_ids[TENANT, GONE])
    assert not builder.forgotten & builder.traces.keys()
    kept_traces = [builder.traces[t] for t in turn_ids[TENANT, KEPT]]
    assert [t.events["received"].text for t in kept_traces] == TURNS  # type: ignore[attr-defined]
    assert all(t.missing is None for t in kept_traces)
    summary = summarize(builder)
    assert summary["forgotten_turns"] == len(TURNS) and summary["complete"] >= 2 * len(TURNS)
    # The replay CLI, configured as the services are (stack.env), says the same.
    out = Path(stack.workdir) / "replay-summary.json"
    run = subprocess.run(
        [str(Path(sys.executable).parent / "mars"), "replay", "read", "--summary", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **{k: v for k, v in stack.env.items() if k.startswith("MARS_")}},
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(out.read_text())["forgotten_turns"] == len(TURNS)

    # The other user of the tenant and the same user id in another tenant: untouched.
    for p in ((TENANT, KEPT), (OTHER_TENANT, GONE)):
        assert rows_of(stack, *p, turn_ids[p]) == before[p], p
    assert {d.replica: list(d.record_ids) for d in describe_all(stack, TENANT, KEPT)} == kept_index
    for described in describe_all(stack, OTHER_TENANT, GONE):
        assert described.lexical_docs == len(TURNS)
    kept = ingress_stub(stack, TENANT).SendTurn(
        svc.TurnRequest(user_id=KEPT, session_id="s", text="Which pier was it again?"), timeout=60
    )
    assert kept.seq == len(TURNS) + 1 and kept.text
    for addr in stack.addrs("memory"):
        with grpc.insecure_channel(addr) as plain:
            view = svc_grpc.MemoryStub(with_identity(plain, stack.caller())).BuildView(
                svc.BuildViewRequest(
                    tenant=TENANT, user_id=KEPT, text="ferry pier time", state=session_state()
                ),
                timeout=30,
            )
            assert turn_ids[TENANT, KEPT][0] in {b.source_turn_id for b in view.blocks}
    # The user's own key went with them (every ingress replica drops it from its key cache on the control
    # event; SubmitFeedback of an unknown turn writes nothing while it is still cached).
    gone_key = ingress_stub(stack, TENANT, GONE)

    def key_refused() -> bool:
        try:
            gone_key.SubmitFeedback(svc.FeedbackRequest(user_id=GONE, turn_id="none", thumbs=1), timeout=30)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    wait_for(key_refused, 15, "the forgotten user's key refused")

    # Again: idempotent, nothing left to delete.
    again = admin_stub(stack, TENANT).ForgetUser(request, timeout=60)
    assert set(again.rows_deleted.values()) == {0} and again.forget_id != reply.forget_id

    # Afresh: seq starts over and no old memory is seen.
    fresh = ingress_stub(stack, TENANT).SendTurn(
        svc.TurnRequest(user_id=GONE, session_id="s2", text="When does my ferry leave?"), timeout=60
    )
    assert fresh.seq == 1
    wait_for(
        lambda: (
            len(
                query(
                    stack, "SELECT 1 FROM memory_records WHERE tenant = %s AND user_id = %s", (TENANT, GONE)
                )
            )
            == 1
        ),
        60,
        "the fresh turn stored",
    )
    old = set(turn_ids[TENANT, GONE])
    for addr in stack.addrs("memory"):
        with grpc.insecure_channel(addr) as plain:
            memory = svc_grpc.MemoryStub(with_identity(plain, stack.caller()))
            view = memory.BuildView(
                svc.BuildViewRequest(
                    tenant=TENANT, user_id=GONE, text="ferry pier peanuts", state=session_state()
                ),
                timeout=30,
            )
            assert not {b.source_turn_id for b in view.blocks} & old
            described = memory.DescribeIndex(
                svc.DescribeIndexRequest(tenant=TENANT, user_id=GONE), timeout=30
            )
            assert described.lexical_docs == 1


def test_forget_user_cli(stack: LocalStack) -> None:
    """`mars forget-user` (Postgres and Kafka directly, no key): the other tenant's user of the test above."""
    people = query(
        stack, "SELECT turn_id FROM ingress_turns WHERE tenant = %s AND user_id = %s", (OTHER_TENANT, GONE)
    )
    turn_ids = [str(r[0]) for r in people]
    assert turn_ids, "runs after test_forget_user"
    env = {**os.environ, **{k: v for k, v in stack.env.items() if k.startswith("MARS_")}}
    run = subprocess.run(
        [str(Path(sys.executable).parent / "mars"), "forget-user", OTHER_TENANT, GONE],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"ingress_turns: {len(turn_ids)} rows deleted" in run.stdout
    assert set(rows_of(stack, OTHER_TENANT, GONE, turn_ids).values()) == {0}
    wait_for(
        lambda: all(d.lexical_docs == 0 for d in describe_all(stack, OTHER_TENANT, GONE)),
        30,
        "every memory replica to drop the index",
    )
    assert rows_of(stack, TENANT, KEPT, [])["memory_records"] >= len(TURNS)  # untouched


def test_keys_check_tells_the_right_master_key_from_another(stack: LocalStack, tmp_path: Path) -> None:
    """`mars keys check`: the stack's master key opens every stored data key; another key opens none."""
    env = {**os.environ, **{k: v for k, v in stack.env.items() if k.startswith("MARS_")}}
    mars = str(Path(sys.executable).parent / "mars")
    stored = int(query(stack, "SELECT count(*) FROM user_data_keys")[0][0])
    assert stored >= 2, "runs after test_forget_user"
    ok = subprocess.run([mars, "keys", "check"], capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{stored} data keys open with the master key, 0 only with the previous one" in ok.stdout
    other = tmp_path / "other.key"
    made = subprocess.run([mars, "keys", "master", "--out", str(other)], capture_output=True, timeout=60)
    assert made.returncode == 0
    wrong = subprocess.run(
        [mars, "keys", "check"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "MARS_MASTER_KEY_FILE": str(other)},
    )
    assert wrong.returncode == 1 and "0 data keys open with the master key, 0 only with the previous one" in (
        wrong.stdout.replace("\n", " ")
    )
    assert f"{stored} with neither" in wrong.stdout


def test_the_master_key_rotates_and_sealed_events_still_open(stack: LocalStack, tmp_path: Path) -> None:
    """`mars keys rotate` re-wraps every data key under a new master key while both are accepted; the data
    keys stay, so the events already sealed on the topics open with the new key alone. Rotated back at the
    end: this stack's services hold the old key."""
    env = {**os.environ, **{k: v for k, v in stack.env.items() if k.startswith("MARS_")}}
    old = stack.env["MARS_MASTER_KEY_FILE"]
    mars = str(Path(sys.executable).parent / "mars")
    new = tmp_path / "new.key"
    assert (
        subprocess.run(
            [mars, "keys", "master", "--out", str(new)], capture_output=True, timeout=60
        ).returncode
        == 0
    )
    stored = int(query(stack, "SELECT count(*) FROM user_data_keys")[0][0])

    def keys(*args: str, current: str, previous: str = "") -> subprocess.CompletedProcess[str]:
        run_env = {**env, "MARS_MASTER_KEY_FILE": current, "MARS_PREVIOUS_MASTER_KEY_FILE": previous}
        return subprocess.run([mars, "keys", *args], capture_output=True, text=True, timeout=120, env=run_env)

    def said(run: subprocess.CompletedProcess[str]) -> str:
        return " ".join((run.stdout + run.stderr).split())  # the console wraps long lines

    dry = keys("rotate", "--dry-run", current=str(new), previous=old)
    assert dry.returncode == 0 and f"would re-wrap {stored} data keys" in said(dry), said(dry)
    during = keys("check", current=str(new), previous=old)
    assert f"0 data keys open with the master key, {stored} only with the previous one" in said(during)
    try:
        rotated = keys("rotate", current=str(new), previous=old)
        assert rotated.returncode == 0 and f"re-wrapped {stored} data keys" in said(rotated), said(rotated)
        assert "re-wrapped 0 data keys" in said(keys("rotate", current=str(new), previous=old))
        after = keys("check", current=str(new))
        assert after.returncode == 0 and f"{stored} data keys open with the master key, 0 only" in said(after)
        assert keys("check", current=old).returncode == 1  # the old key alone opens nothing now
        # Events sealed before the rotation open with the new master key alone.
        new_keys = data_keys.SyncKeyring(
            psycopg.connect(stack.env["MARS_POSTGRES_DSN"], autocommit=True),
            data_keys.MasterKeys(data_keys.sealing.parse_master_key(new.read_text())),
        )
        opened = 0
        for record in read_topic(stack.env["MARS_KAFKA_BOOTSTRAP"], TOPIC_GENERATED):
            event = ev.Generated.FromString(record.value)
            try:
                new_keys.unseal(event)
            except data_keys.Forgotten:
                continue
            opened += event.text != "" and not event.text.startswith("v2:")
        assert opened > 0
    finally:  # this stack's services hold the old key: give it back whatever happened above
        back = keys("rotate", current=old, previous=str(new))
    assert back.returncode == 0 and f"re-wrapped {stored} data keys" in said(back), said(back)
    assert keys("check", current=old).returncode == 0


HISTORY = [
    ("trip", "Book the Lisbon ferry for Saturday morning", "Booked: the 9:40 Tagus ferry on Saturday."),
    ("trip", "Add a seafood dinner in Cacilhas after it", "Added: dinner at Ponto Final, 13:00."),
    ("bread", "Give me a sourdough feeding routine", "Feed 1:1:1 flour, water and starter each morning."),
]


def recorded(*, key_prefix: str = "") -> list[svc.RecordedTurn]:
    return [
        svc.RecordedTurn(
            session_id=s, user_text=u, assistant_text=a, key=f"{key_prefix}{i}" if key_prefix else ""
        )
        for i, (s, u, a) in enumerate(HISTORY)
    ]


def test_import_history_is_idempotent_isolated_per_user_and_never_judged(stack: LocalStack) -> None:
    admin = admin_stub(stack, TENANT)
    first = admin.ImportHistory(
        svc.ImportHistoryRequest(user_id="hist1", turns=recorded(), wait=True), timeout=120
    )
    assert (first.imported, first.already_imported, first.last_seq) == (3, 0, 3)
    assert len(set(first.turn_ids)) == 3
    rows = query(
        stack,
        "SELECT turn_id, session_id, thread_id, seq, user_text FROM memory_records "
        "WHERE tenant = %s AND user_id = %s ORDER BY seq",
        (TENANT, "hist1"),
    )
    assert [(r[0], r[1], r[3], r[4]) for r in rows] == [
        (t, s, i + 1, u) for i, (t, (s, u, _)) in enumerate(zip(first.turn_ids, HISTORY, strict=True))
    ]
    # One thread per session: the two trip pairs share one, the bread pair opened another (now active).
    assert rows[0][2] == rows[1][2] != rows[2][2]
    active = query(
        stack,
        "SELECT thread_id FROM memory_threads WHERE tenant = %s AND user_id = %s AND status = 'ACTIVE'",
        (TENANT, "hist1"),
    )
    assert active == [(rows[2][2],)]
    statuses = query(
        stack, "SELECT DISTINCT status FROM ingress_turns WHERE turn_id = ANY(%s)", (list(first.turn_ids),)
    )
    assert statuses == [("IMPORTED",)]
    # The state service (the table's owner, through ImportContext) keeps the thread the import left
    # active: the bread pair, at the last imported seq.
    context = query(
        stack,
        "SELECT recent_texts, thread_depth, last_seq, session_id FROM state_context "
        "WHERE tenant = %s AND user_id = %s",
        (TENANT, "hist1"),
    )
    assert context == [([HISTORY[2][1]], 1, 3, "bread")]

    # Again, the same pairs (keys derived from their texts): nothing new, same turn ids and seqs.
    again = admin.ImportHistory(
        svc.ImportHistoryRequest(user_id="hist1", turns=recorded(), wait=True), timeout=120
    )
    assert (again.imported, again.already_imported, again.last_seq) == (0, 3, 3)
    assert list(again.turn_ids) == list(first.turn_ids)
    # Explicit keys are ids of their own; the same pairs for another user are that user's alone.
    keyed = admin.ImportHistory(
        svc.ImportHistoryRequest(user_id="hist2", turns=recorded(key_prefix="k"), wait=True), timeout=120
    )
    assert keyed.imported == 3 and not set(keyed.turn_ids) & set(first.turn_ids)
    for user, ids in (("hist1", first.turn_ids), ("hist2", keyed.turn_ids)):
        stored = query(
            stack, "SELECT turn_id FROM memory_records WHERE tenant = %s AND user_id = %s", (TENANT, user)
        )
        assert sorted(r[0] for r in stored) == sorted(ids), user
        for described in describe_all(stack, TENANT, user):
            assert sorted(described.record_ids) == sorted(
                r[0]
                for r in query(
                    stack, "SELECT record_id FROM memory_records WHERE turn_id = ANY(%s)", (list(ids),)
                )
            )

    # A live turn comes after the history (seq 4), sees it (the view's ranking names its sessions, never
    # the other user's records) and continues the state's context of the last imported thread.
    reply = ingress_stub(stack, TENANT).SendTurn(
        svc.TurnRequest(
            user_id="hist1",
            session_id="now",
            text="What did we decide last time about my Lisbon ferry?",
            options={"remember": "false"},
        ),
        timeout=60,
    )
    assert reply.seq == 4 and reply.text
    (view,) = [
        v.view for v in read_events(stack, TOPIC_VIEW, ev.ViewBuilt) if v.turn.turn_id == reply.turn_id
    ]
    hist1_records = {
        str(r[0])
        for r in query(
            stack,
            "SELECT record_id FROM memory_records WHERE tenant = %s AND user_id = %s",
            (TENANT, "hist1"),
        )
    }
    # Its sessions, best first (the live turn's own left out), each with its best record when the view
    # ranked records: hist1's, never hist2's.
    assert [r.session_id for r in view.ranking] == ["trip", "bread"]
    assert {r.record_id for r in view.ranking} - {""} <= hist1_records

    # Imported turns are never judged, rewarded or rateable; replay leaves them out of its traces.
    def judged() -> bool:
        return query(stack, "SELECT count(*) FROM judge_rewards WHERE turn_id = %s", (reply.turn_id,)) == [
            (1,)
        ]

    wait_for(judged, 60, "the live turn judged")
    # Asked with remember=false: answered and judged, not stored; its seq is applied all the same.
    assert query(stack, "SELECT count(*) FROM memory_records WHERE turn_id = %s", (reply.turn_id,)) == [(0,)]
    applied = query(
        stack, "SELECT applied_seq FROM memory_progress WHERE tenant = %s AND user_id = %s", (TENANT, "hist1")
    )
    assert applied == [(4,)]
    imported = list(first.turn_ids) + list(keyed.turn_ids)
    assert query(stack, "SELECT count(*) FROM judge_rewards WHERE turn_id = ANY(%s)", (imported,)) == [(0,)]
    assert query(stack, "SELECT count(*) FROM router_ledger WHERE turn_id = ANY(%s)", (imported,)) == [(0,)]
    with pytest.raises(grpc.RpcError) as info:
        ingress_stub(stack, TENANT).SubmitFeedback(
            svc.FeedbackRequest(user_id="hist1", turn_id=first.turn_ids[0], thumbs=1), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    builder = TraceBuilder(keyring(stack))
    for r in every_record(stack):
        builder.add(r)
    assert builder.counts["imported_records"] >= 6 and not set(imported) & builder.traces.keys()


def test_import_history_refuses_bad_requests_and_writes_nothing(stack: LocalStack) -> None:
    request = svc.ImportHistoryRequest(user_id="hist3", turns=recorded())
    for stub in (ingress_stub(stack, TENANT), ingress_stub(stack, TENANT, "hist3")):
        with pytest.raises(grpc.RpcError) as info:
            stub.ImportHistory(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "importing history takes one" in (info.value.details() or "")
    admin = admin_stub(stack, TENANT)
    bad = recorded()
    bad[1].assistant_text = "ok\x00"
    cases = [
        (svc.ImportHistoryRequest(user_id="hist3"), "turns is empty"),
        (
            svc.ImportHistoryRequest(user_id="hist3", turns=bad),
            "turns[1].assistant_text contains the control",
        ),
        (
            svc.ImportHistoryRequest(user_id="hist3", turns=[recorded()[0], recorded()[0]]),
            "",  # the same pair twice is two pairs (a repeated exchange): accepted, see below
        ),
        (
            svc.ImportHistoryRequest(user_id="hist3", turns=recorded(key_prefix="x")[:1] * 2),
            "turns[1].key 'x0' repeats turns[0].key",
        ),
        (svc.ImportHistoryRequest(user_id="bad user", turns=recorded()), "user_id must match"),
    ]
    for req, message in cases:
        if not message:
            continue
        with pytest.raises(grpc.RpcError) as info:
            admin.ImportHistory(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in (info.value.details() or ""), info.value.details()
    assert query(
        stack, "SELECT count(*) FROM ingress_turns WHERE tenant = %s AND user_id = %s", (TENANT, "hist3")
    ) == [(0,)]
    twice = admin.ImportHistory(cases[2][0], timeout=60)
    assert twice.imported == 2 and len(set(twice.turn_ids)) == 2


def test_import_history_cli_imports_a_file_once(stack: LocalStack, tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text(
        "\n".join(json.dumps({"session_id": s, "user_text": u, "assistant_text": a}) for s, u, a in HISTORY)
    )
    key = mint_key(stack.env["MARS_POSTGRES_DSN"], TENANT, admin=True, label="import cli test").key
    mars = str(Path(sys.executable).parent / "mars")
    command = [mars, "import-history", str(path), "--user", "hist4", "--target", stack.addr("ingress")]
    env = {**os.environ, "MARS_API_KEY": key}
    first = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3 pairs for user hist4: 3 imported, 0 already there (last seq 3)" in " ".join(
        first.stdout.split()
    )
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert "3 pairs for user hist4: 0 imported, 3 already there" in " ".join(again.stdout.split())
    stored = query(
        stack, "SELECT count(*) FROM memory_records WHERE tenant = %s AND user_id = %s", (TENANT, "hist4")
    )
    assert stored == [(3,)]
    # A plain key is refused with the reason, and nothing more is written.
    plain = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MARS_API_KEY": api_key(stack, TENANT)},
    )
    assert plain.returncode == 1 and "PERMISSION_DENIED" in plain.stdout
    path.write_text('{"user_text": "x"}\n{"oops"\n')
    broken = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    # Whitespace normalised: the console wraps the message at its width, where depends on the temp path.
    assert broken.returncode == 2 and "line 2: not JSON" in " ".join(broken.stdout.split())


def test_forget_names_an_owner_that_has_not_acknowledged_and_it_deletes_when_back(stack: LocalStack) -> None:
    """The judge stopped (SIGSTOP) while a user is forgotten: the reply says the judge has not acknowledged,
    the judge's rows stay until it reads the event, and then they go and it acknowledges."""
    user = "late"
    reply = ingress_stub(stack, TENANT).SendTurn(
        svc.TurnRequest(user_id=user, session_id="s", text="Remember that my locker is number 12"), timeout=60
    )
    wait_for(lambda: _settled(stack, [reply.turn_id]), 60, "the turn judged and applied")
    stack.pause("judge")
    try:
        forgot = admin_stub(stack, TENANT).ForgetUser(svc.ForgetUserRequest(user_id=user), timeout=60)
        assert list(forgot.not_acknowledged) == ["judge"]
        assert forgot.rows_deleted["ingress_turns"] == 1 and forgot.rows_deleted["memory_records"] == 1
        assert forgot.rows_deleted["judge_rewards"] == 0  # not the judge's word yet
        held = "SELECT count(*) FROM judge_rewards WHERE tenant = %s AND user_id = %s"
        assert query(stack, held, (TENANT, user))[0][0] == 1
    finally:
        stack.resume("judge")
    wait_for(lambda: query(stack, held, (TENANT, user))[0][0] == 0, 60, "the judge deleting its rows")
    acks = "SELECT rows_deleted FROM ingress_forget_acks WHERE forget_id = %s AND service = 'judge'"
    wait_for(lambda: bool(query(stack, acks, (forgot.forget_id,))), 30, "the judge's acknowledgement")
    assert query(stack, acks, (forgot.forget_id,))[0][0]["judge_rewards"] == 1
