"""The state service's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import STATE_STAGE, TOPIC_CONTROL, TOPIC_RECEIVED, TOPIC_STATE
from mars.spec import ConsumerGroup, ServiceSpec, allow

from mars_state.schema import MIGRATIONS
from mars_state.settings import StateSettings

NAME = "state"
#: Every received turn: its session state estimated.
ESTIMATES = ConsumerGroup("mars-state", NAME, (TOPIC_RECEIVED,))

SPEC = ServiceSpec(
    NAME,
    StateSettings,
    tuple(MIGRATIONS),
    "mars.v1.StateEstimator",
    (ESTIMATES,),
    # ImportContext: the ingress hands over the context a history import leaves (state owns the table).
    {"Estimate": allow("operator"), "ImportContext": allow("ingress")},
    produces=(TOPIC_STATE,),
    broadcast_reads=(TOPIC_CONTROL,),
    stages=(STATE_STAGE,),
)
