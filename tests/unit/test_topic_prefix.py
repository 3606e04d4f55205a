"""Per-run topic prefixes: one helper names every topic, a bad prefix is refused with a clear message, and
the bus puts the prefix in front of the base names services use."""

from __future__ import annotations

import asyncio

import pytest
from mars.bus.consumer import StageConsumer, check_group
from mars.bus.delivery import Subscription
from mars.bus.producer import EventProducer
from mars.config import (
    ALL_TOPICS,
    MAX_TOPIC_LENGTH,
    TOPIC_DEAD_LETTER,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    ServiceSettings,
    Topics,
    topic_name,
    validate_topic_prefix,
)
from mars.spec import ConsumerGroup
from mars.v1 import events_pb2 as ev
from mars_ingress.spec import OUTCOMES
from mars_ingress.spec import SPEC as INGRESS
from mars_memory.spec import SPEC as MEMORY
from mars_state.spec import ESTIMATES
from mars_state.spec import SPEC as STATE
from pydantic import ValidationError


def test_empty_prefix_keeps_todays_names() -> None:
    assert Topics().all == ALL_TOPICS
    assert topic_name(TOPIC_RECEIVED) == "mars.turn.received"
    assert ServiceSettings().topics == Topics("")


def test_prefix_goes_in_front_of_every_topic_and_comes_off_again() -> None:
    topics = Topics("run7.")
    assert topic_name(TOPIC_RECEIVED, "run7.") == "run7.mars.turn.received"
    assert topics.dead_letter == "run7.mars.deadletter"
    assert topics.all == tuple(f"run7.{t}" for t in ALL_TOPICS)
    assert [topics.base(t) for t in topics.all] == list(ALL_TOPICS)
    assert topics.base("mars.turn.received") is None  # another run's (unprefixed) topic
    assert topics.base("run7.something.else") is None
    with pytest.raises(ValueError, match="unknown base topic"):
        topics.name("run7.mars.turn.received")  # a full name is never prefixed twice


@pytest.mark.parametrize("bad", ["run 7.", "run/7.", "ünï.", "a:b"])
def test_illegal_characters_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="characters Kafka does not allow"):
        validate_topic_prefix(bad)


def test_length_limit_counts_the_longest_topic() -> None:
    longest = max(len(t) for t in ALL_TOPICS)
    ok = "x" * (MAX_TOPIC_LENGTH - longest)
    assert max(len(t) for t in Topics(ok).all) == MAX_TOPIC_LENGTH
    with pytest.raises(ValueError, match=f"within Kafka's {MAX_TOPIC_LENGTH}"):
        Topics(ok + "x")


def test_settings_read_and_validate_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_TOPIC_PREFIX", "replay-1700000000.")
    assert ServiceSettings().topics.name(TOPIC_RECEIVED) == "replay-1700000000.mars.turn.received"
    monkeypatch.setenv("MARS_TOPIC_PREFIX", "bad prefix")
    with pytest.raises(ValidationError, match="characters Kafka does not allow"):
        ServiceSettings()


def test_bus_subscribes_publishes_and_groups_under_the_prefix() -> None:
    async def build() -> tuple[EventProducer, StageConsumer]:
        settings = ServiceSettings(topic_prefix="run7.")
        producer = EventProducer(settings, "state")

        async def handler(_: object) -> None:
            return None

        consumer = StageConsumer(
            settings,
            producer,
            INGRESS,
            OUTCOMES,
            [
                Subscription(TOPIC_GENERATED, ev.Generated, handler),
                Subscription(TOPIC_DEAD_LETTER, ev.DeadLetter, handler, requires_envelope=False),
                Subscription(TOPIC_MEMORY_COMMITTED, ev.MemoryCommitted, handler),
                Subscription(TOPIC_JUDGED, ev.Judged, handler),
            ],
        )
        return producer, consumer

    producer, consumer = asyncio.run(build())
    assert producer.topics.dead_letter == "run7.mars.deadletter"
    assert set(consumer._subs) == {
        "run7.mars.turn.generated",
        "run7.mars.deadletter",
        "run7.mars.memory.committed",
        "run7.mars.turn.judged",
    }
    assert consumer._group_id == "run7.mars-ingress-outcomes"


def test_a_stage_consumer_must_handle_exactly_its_groups_topics_in_the_topology() -> None:
    async def handler(_: object) -> None:
        return None

    received = Subscription(TOPIC_RECEIVED, ev.TurnReceived, handler)
    generated = Subscription(TOPIC_GENERATED, ev.Generated, handler)
    check_group(STATE, ESTIMATES, [received])  # what the spec says: accepted
    with pytest.raises(ValueError, match=r"handles mars\.turn\.generated, mars\.turn\.received"):
        check_group(STATE, ESTIMATES, [received, generated])  # a handler the spec does not know
    with pytest.raises(ValueError, match="is not one of memory's"):
        check_group(MEMORY, ESTIMATES, [received])  # another service's group
    stray = ConsumerGroup("state-test", "state", (TOPIC_RECEIVED,))
    with pytest.raises(ValueError, match="consumer group state-test is not one of state's"):
        check_group(STATE, stray, [received])  # a group its spec does not list
