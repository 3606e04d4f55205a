"""The stage topics, created where missing: one shared partition count and replication factor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from mars.config import ALL_TOPICS


@dataclass(frozen=True)
class TopicsEnsured:
    """What `ensure_topics` did: topics created, topics already there, and topics the broker refused
    (name and the broker's reason, e.g. a replication factor above its broker count)."""

    created: tuple[str, ...]
    existing: tuple[str, ...]
    failed: tuple[tuple[str, str], ...] = ()


async def ensure_topics(
    kafka: dict[str, Any],
    partitions: int,
    topics: tuple[str, ...] = ALL_TOPICS,
    replication_factor: int = 1,
) -> TopicsEnsured:
    """Create the stage topics (full names: `ServiceSettings.topics.all` for a prefixed run) with one
    shared partition count and replication factor; existing topics are left alone (their partition count
    is not changed). `kafka`: the client options (`mars.kafka_options.kafka_client_options`)."""
    admin = AIOKafkaAdminClient(**kafka)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(t, num_partitions=partitions, replication_factor=replication_factor)
            for t in topics
            if t not in existing
        ]
        failed: list[tuple[str, str]] = []
        raced: set[str] = set()
        if wanted:
            try:
                response = await admin.create_topics(wanted)
            except TopicAlreadyExistsError:
                raced = {t.name for t in wanted}  # another service created them first
            else:
                # The broker answers per topic; an error there is not raised by the client.
                for topic, code, *message in response.topic_errors:
                    if code == TopicAlreadyExistsError.errno:
                        raced.add(topic)
                    elif code:
                        reason = (message[0] if message else None) or for_code(code).__name__
                        failed.append((topic, str(reason)))
        failed_names = {t for t, _ in failed}
        return TopicsEnsured(
            created=tuple(t.name for t in wanted if t.name not in raced and t.name not in failed_names),
            existing=tuple(t for t in topics if t in existing or t in raced),
            failed=tuple(failed),
        )
    finally:
        await admin.close()
