"""Offsets of a consumer's partitions: what was fetched and is not finished yet (fetched in order,
finished in any), hence what may be committed; and how far behind the consumer is."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition


class PartitionTrack:
    """The offsets of one partition fetched and not finished yet (fetched in order, finished in any)."""

    def __init__(self) -> None:
        self.open: deque[int] = deque()
        self.finished_set: set[int] = set()
        self.next_fetch: int | None = None
        self.committed = -1

    def fetched(self, offset: int) -> None:
        self.open.append(offset)
        self.next_fetch = offset + 1

    def finished(self, offset: int) -> None:
        self.finished_set.add(offset)
        while self.open and self.open[0] in self.finished_set:
            self.finished_set.discard(self.open.popleft())

    def committable(self) -> int | None:
        """The offset to commit: the first unfinished record, or past the last fetched one."""
        if self.open:
            return self.open[0]
        return self.next_fetch


def records_behind(
    consumer: AIOKafkaConsumer, tracks: Mapping[TopicPartition, PartitionTrack]
) -> dict[TopicPartition, int]:
    """Records behind per assigned partition, from the consumer's own view (no broker call): the high
    watermark of its last fetch response minus its first unfinished record (or its position when none is
    open). Partitions never fetched yet (no high watermark) are left out."""
    subscription = consumer._subscription.subscription
    assignment = subscription.assignment if subscription is not None else None
    if assignment is None:
        return {}
    behind: dict[TopicPartition, int] = {}
    for tp in consumer.assignment():
        state = assignment.state_value(tp)
        if state is None or state.highwater is None:
            continue
        track = tracks.get(tp)
        if track is not None and track.open:
            position = track.open[0]
        elif state.has_valid_position:
            position = state.position
        elif track is not None and track.next_fetch is not None:
            position = track.next_fetch
        else:
            continue
        behind[tp] = max(0, state.highwater - position)
    return behind
