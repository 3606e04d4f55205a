"""The router's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import ROUTER_STAGE, TOPIC_CONTROL, TOPIC_JUDGED, TOPIC_ROUTED, TOPIC_VIEW
from mars.spec import ConsumerGroup, ServiceSpec, allow

from mars_router.schema import MIGRATIONS
from mars_router.settings import RouterSettings

NAME = "router"
#: Every view: a model chosen for the turn.
ROUTES = ConsumerGroup("mars-router", NAME, (TOPIC_VIEW,))
#: The judge's verdicts: the policies' updates.
UPDATES = ConsumerGroup("mars-router-updates", NAME, (TOPIC_JUDGED,))

SPEC = ServiceSpec(
    NAME,
    RouterSettings,
    tuple(MIGRATIONS),
    "mars.v1.Router",
    (ROUTES, UPDATES),
    {
        "Route": allow("operator"),
        "GetPolicy": allow("operator", "replay", "deploy"),
        "ResetPolicy": allow("operator"),
    },
    # Control: a canary run's decision (PolicyDecision, mars_router.rollouts).
    produces=(TOPIC_ROUTED, TOPIC_CONTROL),
    # Control: a forgotten user's rows (each owner deletes its own, mars.forget).
    broadcast_reads=(TOPIC_CONTROL,),
    stages=(ROUTER_STAGE,),
)
