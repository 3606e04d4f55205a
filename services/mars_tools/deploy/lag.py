"""Consumer-group lag of the stage groups (`mars.topology`): per group and topic, how many records
are published and not yet committed by the group. The same numbers KEDA scales the stages on.

`topic_lag` is pure; `fetch_lag` asks a live broker (committed offsets through the admin client, first
and end offsets through a group-less consumer that joins nothing and commits nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from mars import topology
from mars.config import Topics
from mars.spec import ConsumerGroup


@dataclass(frozen=True)
class TopicLag:
    #: The group id and topic as on the broker (the run's topic prefix in front).
    group: str
    service: str
    topic: str
    #: Records behind, summed over the topic's partitions; None when the topic does not exist.
    lag: int | None
    partitions: int
    #: Partitions the group has committed nothing on yet: counted from the partition's first offset, where
    #: a new group starts (auto_offset_reset=earliest).
    uncommitted: int


def topic_lag(
    group: str,
    service: str,
    topic: str,
    partitions: Iterable[int],
    committed: Mapping[int, int],
    beginning: Mapping[int, int],
    end: Mapping[int, int],
) -> TopicLag:
    """The lag of `group` on `topic`: per partition, end offset minus the committed offset (or minus the
    first offset where nothing is committed; Kafka reports "none" as -1). Never negative (offsets read at
    slightly different moments)."""
    parts = sorted(partitions)
    if not parts:
        return TopicLag(group, service, topic, None, 0, 0)
    total = 0
    uncommitted = 0
    for p in parts:
        position = committed.get(p, -1)
        if position < 0:
            uncommitted += 1
            position = beginning.get(p, 0)
        total += max(0, end.get(p, position) - position)
    return TopicLag(group, service, topic, total, len(parts), uncommitted)


async def fetch_lag(
    kafka: dict[str, Any], prefix: str = "", groups: Sequence[ConsumerGroup] | None = None
) -> list[TopicLag]:
    """Lag of every stage group on every topic it reads, in pipeline order. Needs a live broker; `kafka`
    are the client options (`mars.kafka_options.kafka_client_options`)."""
    groups = topology.STAGE_GROUPS if groups is None else groups
    names = Topics(prefix)
    admin = AIOKafkaAdminClient(**kafka)
    consumer = AIOKafkaConsumer(**kafka, enable_auto_commit=False)
    await admin.start()
    try:
        await consumer.start()
        try:
            await consumer._client.force_metadata_update()  # type: ignore[attr-defined]
            topics = sorted({names.name(t) for g in groups for t in g.topics})
            parts = {t: sorted(consumer.partitions_for_topic(t) or ()) for t in topics}
            tps = [TopicPartition(t, p) for t in topics for p in parts[t]]
            beginning = await consumer.beginning_offsets(tps) if tps else {}
            end = await consumer.end_offsets(tps) if tps else {}
        finally:
            await consumer.stop()
        out: list[TopicLag] = []
        for group in groups:
            group_id = prefix + group.name
            offsets = await admin.list_consumer_group_offsets(group_id)
            for base in group.topics:
                topic = names.name(base)
                out.append(
                    topic_lag(
                        group_id,
                        group.service,
                        topic,
                        parts[topic],
                        {tp.partition: o.offset for tp, o in offsets.items() if tp.topic == topic},
                        {tp.partition: o for tp, o in beginning.items() if tp.topic == topic},
                        {tp.partition: o for tp, o in end.items() if tp.topic == topic},
                    )
                )
        return out
    finally:
        await admin.close()
