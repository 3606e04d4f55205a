"""The ingress's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import (
    INGRESS_STAGE,
    TOPIC_CONTROL,
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_TOKENS,
)
from mars.spec import ConsumerGroup, ServiceSpec

from mars_ingress.schema import MIGRATIONS
from mars_ingress.settings import IngressSettings

NAME = "ingress"
#: Outcomes of turns (answered, failed), from memory's commits which imported pairs are stored, and from
#: the judge's verdicts what each turn cost (the tenant's daily spend, without reading the judge's table).
#: (Each replica's reply reader is a broadcast reader with no group and no lag to scale on.)
OUTCOMES = ConsumerGroup(
    "mars-ingress-outcomes",
    NAME,
    (TOPIC_GENERATED, TOPIC_DEAD_LETTER, TOPIC_MEMORY_COMMITTED, TOPIC_JUDGED),
)

SPEC = ServiceSpec(
    NAME,
    IngressSettings,
    tuple(MIGRATIONS),
    "mars.v1.Ingress",
    (OUTCOMES,),
    # No permissions: its callers are tenants with API keys (mars.auth), not services.
    # Generated: the answers of an imported history (they go to memory as answered turns do).
    produces=(TOPIC_RECEIVED, TOPIC_FEEDBACK, TOPIC_GENERATED, TOPIC_CONTROL),
    # Each replica reads every reply, streamed token, dead letter and forget (the calls wait there).
    broadcast_reads=(TOPIC_GENERATED, TOPIC_TOKENS, TOPIC_DEAD_LETTER, TOPIC_CONTROL),
    stages=(INGRESS_STAGE,),
)
