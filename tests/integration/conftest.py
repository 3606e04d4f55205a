"""End-to-end fixtures: a real local stack (Apache Kafka, or Tansu where asked; Postgres; llama.cpp server
or the stand-in LLM; six services, each one or more processes) per test module, and helpers to read topics
and tables back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from google.protobuf.message import Message
from mars.auth import mint_key
from mars.config import JUDGE_STAGE
from mars.data_keys import Forgotten
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack, StackSettings, stack_broker_kind, stack_kafka_options
from mars_stack.kafka import choose_broker
from mars_stack.readiness import free_port
from mars_tools.replay.presets import check as check_settings
from mars_tools.replay.readers import behind_end

M = TypeVar("M", bound=Message)
HERE = Path(__file__).parent
REPO = HERE.parents[1]
#: Settings every test stack gets. Answers take seconds here; ingress's turn bound (turn_timeout_s) only
#: matters when something hangs. Checked against the services' settings models, so a misspelt name fails
#: here instead of being ignored.
#: Metric snapshots every 2 s, so a test sees its counters soon after the turns.
STACK_ENV = {
    "MARS_INGRESS_TURN_TIMEOUT_S": "120",
    "MARS_GATEWAY_TURN_TIMEOUT_S": "120",
    "MARS_METRICS_INTERVAL_S": "2",
}


def start_stack(
    tmp: Path,
    pool: str,
    start_llm: bool = True,
    service_env: dict[str, dict[str, str]] | None = None,
    services: tuple[str, ...] | None = None,
    topic_prefix: str = "",
    broker: str | None = None,
    llm: str = "llama",
    replicas: int = 1,
    gateway: bool = False,
) -> LocalStack:
    check_settings(STACK_ENV)
    settings = StackSettings(
        workdir=tmp / "stack",
        model_pool=HERE / pool,
        trace_dir=tmp / "traces",
        start_llm=start_llm,
        service_env=service_env or {},
        topic_prefix=topic_prefix,
        extra_env=dict(STACK_ENV),
        broker=broker,
        llm=llm,
        replicas=replicas,
        gateway=gateway,
    )
    if services is not None:
        settings.services = services
    return LocalStack(settings).start()


#: Stacks that adjacent modules share, by the name of the fixture that hands them out: started by the first
#: test that needs one, stopped right after the last test of the run that uses it (`_LAST_USER`). Under
#: xdist the modules that share one must be one scope (tests/conftest.py: LLAMA_MODULES,
#: SHARED_STACK_MODULES), else each worker that runs one of them starts a stack of its own. A
#: session-scoped fixture would keep it up to the end of the run, idle but not free: its broker and services
#: took about a sixth of a core, on 2 cores, from every module after its last user.
_SHARED: dict[str, LocalStack] = {}
_LAST_USER: dict[str, str] = {}


def shared_stack(start: Callable[[Path], LocalStack]) -> Any:
    """A module-scoped fixture named as `start` that hands out one stack, made by `start(workdir)` for the
    first module that asks and stopped after the run's last test that uses it."""
    name = start.__name__
    _LAST_USER[name] = ""

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> LocalStack:
        if name not in _SHARED:
            _SHARED[name] = start(tmp_path_factory.mktemp(name))
        return _SHARED[name]

    fixture.__doc__ = start.__doc__
    return fixture


def pytest_collection_finish(session: pytest.Session) -> None:
    """Which test is each shared stack's last user in this run (its order, after any selection)."""
    for item in session.items:
        for name in _LAST_USER:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test's own teardown: stop each shared stack whose last user it was."""
    for name in list(_SHARED):
        if nextitem is None or _LAST_USER.get(name) == item.nodeid:
            _SHARED.pop(name).stop()


@shared_stack
def smollm2_stack(tmp: Path) -> LocalStack:
    """The SmolLM2 stack of test_pipeline and test_pipeline_features (adjacent by name), started once: each
    module talks as tenants and users of its own and reads back only its own turns' events and rows."""
    return start_stack(tmp, "models.test.yaml")


#: The front door's stack (test_gateway, test_ingress_security): the key cache's TTL, and the quotas of the
#: tenants those modules hold to them (one turn then a long wait; slow turns; tokens; spend; history).
AUTH_CACHE_TTL_S = 1.0
GATEWAY_QUOTA_TENANT = "gw-quota"
FRONT_DOOR_QUOTAS = {
    GATEWAY_QUOTA_TENANT: {"turns_per_s": 0.001, "turn_burst": 1},
    "limited": {"turns_per_s": 0.05, "turn_burst": 2},
    "wordy": {"tokens_per_min": 60},
    "spender": {"usd_per_day": 1e-12},
    "historian": {"tokens_per_min": 60},
}
GATEWAY_METRICS_PORT = free_port()


@shared_stack
def front_door_stack(tmp: Path) -> LocalStack:
    """The stand-in stack with the gateway in front, shared by test_gateway and test_ingress_security
    (adjacent by name): each module holds its own tenants and users, and reads back only its own rows."""
    return start_stack(
        tmp,
        "models.standin-test.yaml",  # the stand-in LLM: the protocols are under test, not the words
        llm="standin",
        service_env={
            "judge": {"MARS_JUDGE_FEEDBACK_MODE": "replace"},
            "ingress": {
                "MARS_INGRESS_AUTH_CACHE_TTL_S": str(AUTH_CACHE_TTL_S),
                "MARS_INGRESS_QUOTA_TENANTS": json.dumps(FRONT_DOOR_QUOTAS),
                "MARS_INGRESS_QUOTA_SPEND_CACHE_S": "0",
                "MARS_INGRESS_QUOTA_BUDGET_CACHE_S": "0",
            },
            "gateway": {"MARS_GATEWAY_METRICS_PORT": str(GATEWAY_METRICS_PORT)},
        },
        gateway=True,
    )


#: The judge's per-tenant feedback settings of test_feedback's tenants (the stack it shares with test_eval).
FEEDBACK_MODES = {"fb-replace": "replace", "fb-blend": "blend"}
FEEDBACK_BLEND_WEIGHT = 0.25
FEEDBACK_LAMBDAS = {"fb-blend": 0.5}


@shared_stack
def standin_stack(tmp: Path) -> LocalStack:
    """A stand-in stack with short answers, shared by test_eval, test_feedback and test_replay (one xdist
    scope: tests/conftest.py, SHARED_STACK_MODULES): no test there reads the answers' words; the judge's
    feedback settings are those of test_feedback's tenants alone, and each module reads back only its own
    tenants' turns (test_replay: the log from where its turns begin, `--since-ms`)."""
    judge = {
        "MARS_JUDGE_FEEDBACK_TENANT_MODES": json.dumps(FEEDBACK_MODES),
        "MARS_JUDGE_FEEDBACK_BLEND_WEIGHT": str(FEEDBACK_BLEND_WEIGHT),
        "MARS_JUDGE_LAMBDA_TENANTS": json.dumps(FEEDBACK_LAMBDAS),
    }
    return start_stack(
        tmp,
        "models.standin-test.yaml",
        llm="standin",
        service_env={"dispatch": {"MARS_DISPATCH_DEFAULT_MAX_TOKENS": "8"}, "judge": judge},
    )


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Postgres server of the module's own (no broker, no LLM, no services, no schema yet): its DSN."""
    stack = LocalStack(
        StackSettings(
            workdir=tmp_path_factory.mktemp("pg"),
            start_llm=False,
            start_broker=False,
            services=(),
            postgres_roles=False,  # an empty database: the tests apply the schema
        )
    ).start()
    try:
        yield stack.env["MARS_POSTGRES_DSN"]
    finally:
        stack.stop()


_KEYS: dict[tuple[str, str, str | None], str] = {}


def api_key(stack: LocalStack, tenant: str, user: str | None = None) -> str:
    """An API key for `tenant` (limited to `user` when given) in the stack's Postgres, made once per stack."""
    dsn = stack.env["MARS_POSTGRES_DSN"]
    if (dsn, tenant, user) not in _KEYS:
        _KEYS[dsn, tenant, user] = mint_key(dsn, tenant, user, label="tests").key
    return _KEYS[dsn, tenant, user]


def ingress_stub(
    stack: LocalStack, tenant: str, user: str | None = None, addr: str | None = None
) -> svc_grpc.IngressStub:
    """A stub for the stack's ingress (or the replica at `addr`) that calls with a key of `tenant`."""
    return svc_grpc.IngressStub(ingress_channel(addr or stack.addr("ingress"), api_key(stack, tenant, user)))


def read_topic(bootstrap: str, topic: str, idle_s: float = 1.5) -> list[Any]:
    """All records of a topic from the beginning: on Apache Kafka, up to the end offsets it reports when the
    read begins (every record acknowledged before the call); elsewhere (Tansu, whose end offsets have been
    seen wrong) until the topic has been idle for `idle_s`."""
    to_end = stack_broker_kind(bootstrap) == "kafka"

    async def _read() -> list[Any]:
        consumer = AIOKafkaConsumer(
            **stack_kafka_options(bootstrap), enable_auto_commit=False, fetch_max_wait_ms=50
        )
        try:
            await consumer.start()  # inside: a start that fails (a broker restarting) still closes it
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            out: list[Any] = []
            if to_end:
                ends = await consumer.end_offsets(tps)
                deadline = time.monotonic() + 60
                while await behind_end(consumer, ends):
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{topic}: not read to its end offsets {ends} within 60 s")
                    batch = await consumer.getmany(*tps, timeout_ms=200)
                    for records in batch.values():
                        out.extend(records)
                return out
            last = time.monotonic()
            while time.monotonic() - last < idle_s:
                batch = await consumer.getmany(timeout_ms=200)
                for records in batch.values():
                    out.extend(records)
                    last = time.monotonic()
            return out
        finally:
            await consumer.stop()

    return asyncio.run(_read())


def keys_env(stack: LocalStack) -> dict[str, str]:
    """The environment of a tool run beside `stack` that opens its sealed event text (as `mars replay` is
    run with the stack's stack.env): the master key file and the Postgres holding the data keys."""
    import os

    keys = {k: stack.env[k] for k in ("MARS_MASTER_KEY_FILE", "MARS_POSTGRES_DSN") if k in stack.env}
    return {**os.environ, **keys, **stack.kafka_env("operator")}  # and the tools' Kafka login


def read_events(stack: LocalStack, topic: str, cls: type[M], idle_s: float = 1.5) -> list[M]:
    """The events of a stage topic, their user text opened with the stack's data keys (as a stage sees
    them); a forgotten user's events are left out."""
    keys = stack.keyring()
    out: list[M] = []
    for record in read_topic(stack.env["MARS_KAFKA_BOOTSTRAP"], topic, idle_s):
        event = cls.FromString(record.value)
        if keys is not None:
            try:
                keys.unseal(event)
            except Forgotten:
                continue
        out.append(event)
    return out


def produce_raw(bootstrap: str, topic: str, payload: bytes, key: bytes, principal: str = "operator") -> None:
    """One record, produced as `principal` (a service, or the tools' operator) where the broker has logins."""

    async def _send() -> None:
        producer = AIOKafkaProducer(**stack_kafka_options(bootstrap, principal), enable_idempotence=False)
        await producer.start()
        try:
            await producer.send_and_wait(topic, payload, key=key)
        finally:
            await producer.stop()

    asyncio.run(_send())


def query(stack: LocalStack, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"]) as conn:
        return list(conn.execute(sql, params).fetchall())  # type: ignore[arg-type]


def talk_concurrently(users: Iterable[str], talk: Callable[[str], None]) -> None:
    """`talk(user)` for every user at once, each in a thread of its own (each user's turns in order); what any
    of them raised fails the caller."""
    errors: list[BaseException] = []

    def run(user: str) -> None:
        try:
            talk(user)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def wait_judged(stack: LocalStack, turn_ids: list[str], timeout_s: float = 90.0) -> None:
    """Until every turn's Judged event, a trace's last, is on the log: the judge writes its ledger row
    (stage_emitted) only after the broker acknowledged the event. A read to the end offsets after this
    (`mars replay --until end`) finds every turn complete."""
    sql = "SELECT count(*) FROM stage_emitted WHERE stage = %s AND turn_id = ANY(%s)"
    wait_for(
        lambda: int(query(stack, sql, (JUDGE_STAGE, turn_ids))[0][0]) == len(turn_ids),
        timeout_s,
        f"the Judged events of {len(turn_ids)} turns",
    )


def wait_for(check: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@contextlib.contextmanager
def broker_only(workdir: Path, **settings: Any) -> Iterator[LocalStack]:
    """Apache Kafka alone (no Postgres, LLM or services), with `settings` (StackSettings fields) on top;
    stopped after. Skips where Kafka cannot run."""
    require_kafka()
    stack = LocalStack(
        StackSettings(
            workdir=workdir, start_postgres=False, start_llm=False, services=(), broker="kafka", **settings
        )
    ).start()
    try:
        yield stack
    finally:
        stack.stop()


def require_kafka() -> None:
    """Skip where Apache Kafka cannot run: it needs Java >= 17, and without it the stack falls back to
    Tansu, which these replica and restart tests are not about."""
    if choose_broker() != "kafka":
        pytest.skip(
            "Java >= 17 is not installed here, so Apache Kafka cannot run (the stack would use Tansu)"
        )


def run_harness(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run one of the load-tests/ harnesses as its own process, as a user would."""
    return subprocess.run(
        [sys.executable, str(REPO / "load-tests" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def session_state(**kw: object) -> ev.SessionState:
    """A QTM state that asks memory for retrieval (MATCH, global scope, top-k 5); `kw` overrides fields,
    `need_memory` the taxonomy flag."""
    s = ev.SessionState(
        action=ev.MATCH,
        query_type=ev.DYNAMIC,
        phase=ev.EXPLORE,
        retrieval_scope=ev.GLOBAL,
        top_k_hint=5,
        prefer_recent=0,
        lens_recommendation=3,
    )
    s.taxonomy.need_memory = 1
    for key, value in kw.items():
        if key == "need_memory":
            s.taxonomy.need_memory = value  # type: ignore[assignment]
        else:
            setattr(s, key, value)
    return s
