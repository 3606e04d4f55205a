"""The Kubernetes hook commands against real servers: `mars migrate` on the embedded Postgres, `mars topics
ensure|list` on Apache Kafka, consumer-group lag as `mars deploy status` reads it, and every client
logging in over SASL (a SASL_PLAINTEXT listener with PLAIN logins) from the MARS_KAFKA_* settings."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from conftest import broker_only
from mars.config import TOPIC_RECEIVED, ServiceSettings, Topics
from mars.kafka_options import kafka_client_options
from mars_stack import LocalStack
from mars_state.spec import ESTIMATES
from mars_tools.deploy.lag import fetch_lag

pytestmark = pytest.mark.integration

SASL_USER, SASL_PASSWORD = "mars-it", "it-secret"


def mars(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "mars")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MARS_")}
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=300, check=False, env={**clean, **(env or {})}
    )


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with broker_only(
        tmp_path_factory.mktemp("kafka") / "stack",
        kafka_sasl_users={SASL_USER: SASL_PASSWORD},
        kafka_security="plaintext",  # beside the SASL_PLAINTEXT listener these tests log in to
    ) as stack:
        yield stack


def test_migrate_applies_every_schema_and_is_idempotent(postgres: str) -> None:
    first = mars("migrate", "--postgres-dsn", postgres)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "table router_ledger" in first.stdout and "table stage_emitted" in first.stdout
    assert "schema up to date" in first.stdout
    with psycopg.connect(postgres) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {
        "stage_emitted", "ingress_turns", "ingress_user_seq", "memory_records", "memory_threads",
        "memory_progress", "router_policies", "router_arms", "router_decisions", "router_ledger",
        "judge_feedback", "judge_rewards", "state_context",
    } <= tables  # fmt: skip
    again = mars("migrate", env={"MARS_POSTGRES_DSN": postgres})  # the DSN from the environment
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("nothing new") == 6


def test_migrate_roles_takes_a_database_made_with_one_login_over(postgres: str, tmp_path: Path) -> None:
    """`mars migrate --roles` (the chart's migrate Job) on the schema of one login: each table goes to its
    service's role, a password comes from the Secret-shaped directory, and that role reads its own table
    and is refused another's."""
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "password").write_text("judge-secret\n")
    run = mars("migrate", "--postgres-dsn", postgres, "--roles", "--role-passwords-dir", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mars_judge" in run.stdout and "mars_operator" in run.stdout
    judge = psycopg.conninfo.make_conninfo(postgres, user="mars_judge", password="judge-secret")
    with psycopg.connect(judge, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM judge_rewards")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM ingress_turns")
    bad = mars("migrate", "--postgres-dsn", postgres, "--roles", "--role-prefix", "Bad-Prefix")
    assert bad.returncode == 2 and "role prefix" in bad.stdout


def test_migrate_reports_an_unreachable_postgres_in_one_line() -> None:
    run = mars(
        "migrate", "--postgres-dsn", "postgresql://mars@127.0.0.1:1/mars?connect_timeout=1", "--wait-s", "2"
    )
    assert run.returncode == 1
    assert "migration failed" in run.stdout and "Traceback" not in run.stdout + run.stderr


def test_topics_ensure_over_sasl_creates_then_leaves_alone(kafka: LocalStack) -> None:
    sasl = {
        "MARS_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka.ports['broker-sasl']}",
        "MARS_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "MARS_KAFKA_SASL_MECHANISM": "PLAIN",
        "MARS_KAFKA_SASL_USERNAME": SASL_USER,
        "MARS_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
        "MARS_TOPIC_PREFIX": "hook1.",
    }
    first = mars("topics", "ensure", "--partitions", "2", env=sasl)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count("created hook1.") == len(Topics().all)
    again = mars("topics", "ensure", "--partitions", "2", env=sasl)
    assert again.returncode == 0 and again.stdout.count("exists  hook1.") == len(Topics().all)
    listed = mars("topics", "list", env=sasl)
    assert listed.returncode == 0, listed.stdout
    assert "hook1.mars.turn.received" in listed.stdout
    # A wrong password is refused by the broker: an error, not a hang.
    wrong = mars("topics", "list", "--timeout-s", "20", env={**sasl, "MARS_KAFKA_SASL_PASSWORD": "nope"})
    assert wrong.returncode == 1 and "cannot reach Kafka" in wrong.stdout
    # SASL without a username: refused at settings load, naming the variable.
    bad = mars("topics", "list", env={**sasl, "MARS_KAFKA_SASL_USERNAME": ""})
    assert bad.returncode == 2 and "MARS_KAFKA_SASL_USERNAME" in bad.stdout


def test_topics_ensure_reports_what_the_broker_refuses(kafka: LocalStack) -> None:
    env = {"MARS_KAFKA_BOOTSTRAP": kafka.env["MARS_KAFKA_BOOTSTRAP"]}
    run = mars("topics", "ensure", "--topic-prefix", "rf3.", "--replication-factor", "3", env=env)
    assert run.returncode == 1, run.stdout
    assert "FAILED  rf3.mars.turn.received" in run.stdout  # one broker cannot hold three replicas
    missing = mars("topics", "list", "--topic-prefix", "rf3.", env=env)
    assert missing.returncode == 1 and "missing" in missing.stdout


def test_lag_of_a_stage_group_over_sasl(kafka: LocalStack) -> None:
    prefix = "lag1."
    settings = ServiceSettings(
        kafka_bootstrap=f"127.0.0.1:{kafka.ports['broker-sasl']}",
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_username=SASL_USER,
        kafka_sasl_password=SASL_PASSWORD,
        topic_prefix=prefix,
        kafka_partitions=2,
    )
    options = kafka_client_options(settings)
    topic = Topics(prefix).name(TOPIC_RECEIVED)

    async def scenario() -> None:
        from mars.bus.topics import ensure_topics

        ensured = await ensure_topics(options, 2, Topics(prefix).all)
        assert not ensured.failed
        producer = AIOKafkaProducer(**options)
        await producer.start()
        try:
            for i in range(10):
                await producer.send_and_wait(topic, b"x", partition=i % 2)
        finally:
            await producer.stop()
        # The state group has handled 3 records of partition 0 and nothing of partition 1.
        consumer = AIOKafkaConsumer(**options, group_id=prefix + ESTIMATES.name, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])  # assigned, not subscribed: no group join to wait for
            await consumer.commit({TopicPartition(topic, 0): 3})
        finally:
            await consumer.stop()
        lags = {(row.group, row.topic): row for row in await fetch_lag(options, prefix)}
        state = lags[(prefix + ESTIMATES.name, topic)]
        assert (state.lag, state.partitions, state.uncommitted) == (2 + 5, 2, 1)
        untouched = lags[(prefix + "mars-router", Topics(prefix).name("mars.turn.view"))]
        assert (untouched.lag, untouched.uncommitted) == (0, 2)

    asyncio.run(scenario())
