"""The launcher supervises like a kubelet: a process that dies is started again on the same port with
its data (Postgres and Apache Kafka keep theirs on disk), and Tansu still runs the pipeline where Java
is missing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psycopg
import pytest
from aiokafka import AIOKafkaProducer
from conftest import STACK_ENV, read_topic, require_kafka, wait_for
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from mars_ingress.client import ingress_channel
from mars_stack import LocalStack, StackSettings, stack_kafka_options
from mars_stack.readiness import StackError, tcp_open

pytestmark = [pytest.mark.integration, pytest.mark.resilience]
REPO = Path(__file__).resolve().parents[2]
#: A topic of its own, under the run's "mars." names (the tools' principal may use those alone).
KEPT = "mars.test.kept"


def _restarted(stack: LocalStack, name: str) -> bool:
    return any(e.name == name and e.kind == "restarted" for e in stack.events)


def test_a_part_that_cannot_start_fails_the_stack_and_stops_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Postgres, the broker and the LLM server start together: the broker's failure is the stack's, and
    # the two that did come up are stopped, not left running.
    monkeypatch.setenv("MARS_JAVA", "/bin/false")
    stack = LocalStack(StackSettings(workdir=tmp_path / "stack", broker="kafka", services=()))
    with pytest.raises(StackError, match="formatting the Kafka log dir failed"):
        stack.start()
    assert {"postgres", "llm"} <= set(stack.ports)  # both were up when the start failed
    assert not stack.procs
    assert not tcp_open(stack.ports["postgres"]) and not tcp_open(stack.ports["llm"])


def test_postgres_killed_comes_back_with_its_data(tmp_path: Path) -> None:
    stack = LocalStack(
        StackSettings(workdir=tmp_path / "stack", start_llm=False, start_broker=False, services=())
    ).start()
    try:
        dsn = stack.env["MARS_POSTGRES_DSN"]
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (v TEXT)")
            conn.execute("INSERT INTO kept VALUES ('before the crash')")
        stack.kill("postgres")
        wait_for(lambda: _restarted(stack, "postgres"), 30, "the supervisor to restart postgres")

        def answers() -> bool:
            try:
                with psycopg.connect(dsn, connect_timeout=1) as conn:
                    return conn.execute("SELECT v FROM kept").fetchall() == [("before the crash",)]
            except psycopg.OperationalError:
                return False

        wait_for(answers, 30, "postgres to answer on its old port with its data")
        assert any(e.name == "postgres" and e.kind == "exited" for e in stack.events)
    finally:
        stack.stop()


def test_kafka_killed_comes_back_with_its_topics(tmp_path: Path) -> None:
    require_kafka()
    stack = LocalStack(
        StackSettings(
            workdir=tmp_path / "stack", start_llm=False, start_postgres=False, services=(), broker="kafka"
        )
    ).start()
    try:
        bootstrap = stack.env["MARS_KAFKA_BOOTSTRAP"]

        async def produce() -> None:
            producer = AIOKafkaProducer(**stack_kafka_options(bootstrap), enable_idempotence=True, acks="all")
            await producer.start()
            try:
                for i in range(5):
                    await producer.send_and_wait(KEPT, f"m{i}".encode(), key=b"k")
            finally:
                await producer.stop()

        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        async def create() -> None:
            admin = AIOKafkaAdminClient(**stack_kafka_options(bootstrap))
            await admin.start()
            try:
                await admin.create_topics([NewTopic(KEPT, num_partitions=1, replication_factor=1)])
            finally:
                await admin.close()

        asyncio.run(create())
        asyncio.run(produce())
        started = time.monotonic()
        stack.kill("broker")
        wait_for(lambda: _restarted(stack, "broker"), 30, "the supervisor to restart Kafka")

        def serves_old_records() -> bool:
            try:
                return len(read_topic(bootstrap, KEPT)) == 5
            except Exception:  # not listening yet
                return False

        wait_for(serves_old_records, 90, "Kafka to serve its old records")
        assert [r.value for r in read_topic(bootstrap, KEPT)] == [f"m{i}".encode() for i in range(5)]
        assert time.monotonic() - started < 90
    finally:
        stack.stop()


def test_pipeline_smoke_on_tansu(tmp_path: Path) -> None:
    """The fallback broker (no Java) still carries turns end to end."""
    stack = LocalStack(
        StackSettings(
            workdir=tmp_path / "stack",
            model_pool=REPO / "config" / "models.standin.yaml",
            llm="standin",
            broker="tansu",
            extra_env=dict(STACK_ENV),
        )
    ).start()
    try:
        assert stack.broker == "tansu" and stack.env["MARS_KAFKA_IDEMPOTENCE"] == "false"
        with ingress_channel(stack.addr("ingress"), stack.env["MARS_API_KEY"]) as channel:
            stub = svc_grpc.IngressStub(channel)
            for n in (1, 2):
                reply = stub.SendTurn(
                    svc.TurnRequest(user_id="tansu-user", text=f"hello number {n}"), timeout=90
                )
                assert reply.seq == n and reply.text.startswith("Noted")
    finally:
        stack.stop()
