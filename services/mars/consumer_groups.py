"""The Kafka consumer groups of the turn stages: which service runs each and which topics it reads.

One definition for the services (they join these groups), `mars deploy status` (lag per group) and the
Helm chart's KEDA triggers (the chart tests check its triggers against this table). Names are before the
run's topic prefix, which goes in front of group and topic names alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars.config import (
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)


@dataclass(frozen=True)
class ConsumerGroup:
    name: str
    service: str
    topics: tuple[str, ...]


STATE = ConsumerGroup("mars-state", "state", (TOPIC_RECEIVED,))
#: Views read the state topic, and the received topic to start the query's embedding early.
MEMORY_VIEW = ConsumerGroup("mars-memory-view", "memory", (TOPIC_STATE, TOPIC_RECEIVED))
MEMORY_WRITER = ConsumerGroup("mars-memory-writer", "memory", (TOPIC_GENERATED,))
ROUTER = ConsumerGroup("mars-router", "router", (TOPIC_VIEW,))
ROUTER_UPDATES = ConsumerGroup("mars-router-updates", "router", (TOPIC_JUDGED,))
DISPATCH = ConsumerGroup("mars-dispatch", "dispatch", (TOPIC_ROUTED,))
JUDGE = ConsumerGroup("mars-judge", "judge", (TOPIC_GENERATED, TOPIC_FEEDBACK))
INGRESS_OUTCOMES = ConsumerGroup("mars-ingress-outcomes", "ingress", (TOPIC_GENERATED, TOPIC_DEAD_LETTER))

#: Every stage group, in pipeline order. (Each ingress replica's reply reader is a broadcast reader with no
#: group and no lag to scale on.)
STAGE_GROUPS: tuple[ConsumerGroup, ...] = (
    STATE,
    MEMORY_VIEW,
    ROUTER,
    DISPATCH,
    MEMORY_WRITER,
    JUDGE,
    ROUTER_UPDATES,
    INGRESS_OUTCOMES,
)
