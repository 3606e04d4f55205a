"""The dispatch service's spec (mars.spec): what the runtime, the launcher and the deployment know of it."""

from __future__ import annotations

from mars.config import DISPATCH_STAGE, TOPIC_CONTROL, TOPIC_GENERATED, TOPIC_ROUTED, TOPIC_TOKENS
from mars.spec import ConsumerGroup, ServiceSpec, allow

from mars_dispatch.settings import DispatchSettings

NAME = "dispatch"
#: Every routed turn: the chosen model generates the answer.
GENERATES = ConsumerGroup("mars-dispatch", NAME, (TOPIC_ROUTED,))

SPEC = ServiceSpec(
    NAME,
    DispatchSettings,
    # No tables of its own: only the shared stage ledger.
    (),
    "mars.v1.Dispatch",
    (GENERATES,),
    {"Generate": allow("operator"), "ListModels": allow("operator", "deploy")},
    produces=(TOPIC_GENERATED, TOPIC_TOKENS),
    broadcast_reads=(TOPIC_CONTROL,),
    stages=(DISPATCH_STAGE,),
)
