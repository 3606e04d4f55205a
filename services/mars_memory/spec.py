"""The memory service's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import (
    MEMORY_COMMIT_STAGE,
    MEMORY_VIEW_STAGE,
    TOPIC_CONTROL,
    TOPIC_GENERATED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)
from mars.spec import ConsumerGroup, ServiceSpec, allow

from mars_memory.schema import MIGRATIONS
from mars_memory.settings import MemorySettings

NAME = "memory"
#: Views read the state topic (whose events carry the turn's embedding when the controller made one).
VIEWS = ConsumerGroup("mars-memory-view", NAME, (TOPIC_STATE,))
#: Answered turns, committed to the user's memory.
WRITER = ConsumerGroup("mars-memory-writer", NAME, (TOPIC_GENERATED,))

SPEC = ServiceSpec(
    NAME,
    MemorySettings,
    tuple(MIGRATIONS),
    "mars.v1.Memory",
    (VIEWS, WRITER),
    {"BuildView": allow("operator"), "DescribeIndex": allow("operator", "chaos")},
    produces=(TOPIC_VIEW, TOPIC_MEMORY_COMMITTED),
    broadcast_reads=(TOPIC_CONTROL,),
    stages=(MEMORY_VIEW_STAGE, MEMORY_COMMIT_STAGE),
)
