"""Kafka principals and ACLs on the local broker (SASL_SSL, SCRAM-SHA-512, StandardAuthorizer), as every
stack runs it by default: each service's principal may write only the topics it produces, read only the
ones it consumes and join only its own groups (mars.kafka_acls from mars.topology); a client without a
login, or with a wrong one, gets nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    TopicAuthorizationFailedError,
)
from conftest import broker_only
from mars import topology
from mars.config import ALL_TOPICS, TOPIC_RECEIVED, Topics
from mars_stack import LocalStack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with broker_only(tmp_path_factory.mktemp("acls") / "stack") as stack:  # SASL_SSL, the default
        yield stack


async def _produce(options: dict[str, object], topic: str) -> None:
    producer = AIOKafkaProducer(**options)  # type: ignore[arg-type]
    try:
        await producer.start()
        await producer.send_and_wait(topic, b"acl probe", key=b"t/u")
    finally:
        await producer.stop()


async def _consume(options: dict[str, object], topic: str, group: str) -> None:
    """Join `group` on `topic` and fetch once (an authorization failure is raised, not waited out)."""
    consumer = AIOKafkaConsumer(
        topic,
        **options,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,  # type: ignore[arg-type]
    )
    try:
        await consumer.start()
        await consumer.getmany(timeout_ms=3000)
    finally:
        await consumer.stop()


def test_the_stack_runs_sasl_ssl_and_hands_the_tools_the_operator_login(broker: LocalStack) -> None:
    assert broker.kafka_security == "sasl_ssl"
    env = broker.env
    assert env["MARS_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert (
        env["MARS_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512" and env["MARS_KAFKA_SASL_USERNAME"] == "operator"
    )
    # Each service gets its own login, never the operator's.
    for name in topology.NAMES:
        login = broker.kafka_env(name)
        assert login["MARS_KAFKA_SASL_USERNAME"] == name
        assert login["MARS_KAFKA_SASL_PASSWORD"] != env["MARS_KAFKA_SASL_PASSWORD"]
    # The broker's config holds the passwords: private.
    assert (broker.workdir / "kafka" / "server.properties").stat().st_mode & 0o077 == 0
    assert (broker.workdir / "kafka" / "logins.json").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("service", topology.NAMES)
def test_each_service_writes_and_reads_only_its_own_topics_and_groups(
    broker: LocalStack, service: str
) -> None:
    spec = topology.service(service)
    topics = Topics("")
    options = broker.kafka_options(service)
    own = spec.produces[0]
    foreign = next(t for t in ALL_TOPICS if t not in spec.writes)
    unread = next(t for t in ALL_TOPICS if t not in spec.reads)
    other_group = next(g for g in topology.STAGE_GROUPS if g.service != service)

    asyncio.run(_produce(options, topics.name(own)))  # allowed
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_produce(options, topics.name(foreign)))
    if spec.groups:
        group = spec.groups[0]
        asyncio.run(_consume(options, topics.name(group.topics[0]), group.name))  # allowed
    with pytest.raises((TopicAuthorizationFailedError, GroupAuthorizationFailedError)):
        asyncio.run(_consume(options, topics.name(unread), spec.groups[0].name if spec.groups else "x"))
    with pytest.raises(GroupAuthorizationFailedError):
        asyncio.run(_consume(options, topics.name(other_group.topics[0]), other_group.name))


def test_a_client_without_a_login_or_with_a_wrong_one_gets_nothing(
    broker: LocalStack, tmp_path: Path
) -> None:
    options = broker.kafka_options("operator")
    anonymous = {k: v for k, v in options.items() if not k.startswith("sasl_")}
    anonymous["security_protocol"] = "SSL"
    with pytest.raises(KafkaConnectionError):
        asyncio.run(_produce(anonymous, TOPIC_RECEIVED))
    wrong = {**options, "sasl_plain_password": "not-the-password"}
    with pytest.raises(KafkaError):
        asyncio.run(_produce(wrong, TOPIC_RECEIVED))
    # Without TLS the SASL_SSL listener answers nothing at all.
    plain = {"bootstrap_servers": options["bootstrap_servers"]}
    with pytest.raises(KafkaError):
        asyncio.run(_produce(plain, TOPIC_RECEIVED))


def test_the_operator_may_use_the_runs_topics_only(broker: LocalStack) -> None:
    options = broker.kafka_options("operator")
    asyncio.run(_produce(options, TOPIC_RECEIVED))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_produce(options, "not-mars.other-topic"))
