"""The deployment's topology in one declarative place: every service with its settings model, its schema,
its Kafka consumer groups (topics it reads), its gRPC service and the callers that may use each method.

The local launcher (mars_stack), `mars migrate`, the replay presets, the chaos harness, `mars deploy status`,
the chart tests (KEDA triggers) and the identity interceptor all read this table; each StageConsumer checks
its subscriptions against its group here. Services are named by module path and imported by that string only
when their settings class or migrations are asked for (`ServiceSpec.settings_class`, `.migrations`): not at
import time, so the core imports nothing above it, but those calls do reach up into the services at run
time, where `.importlinter` cannot see it. Group and topic names are before the run's topic prefix.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mars.config import (
    DISPATCH_STAGE,
    INGRESS_STAGE,
    JUDGE_STAGE,
    MEMORY_COMMIT_STAGE,
    MEMORY_VIEW_STAGE,
    ROUTER_STAGE,
    STATE_STAGE,
    TOPIC_CONTROL,
    TOPIC_DEAD_LETTER,
    TOPIC_FEEDBACK,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_RECEIVED,
    TOPIC_ROUTED,
    TOPIC_STATE,
    TOPIC_TOKENS,
    TOPIC_VIEW,
    CallerSettings,
    ServiceSettings,
    env_name,
)


@dataclass(frozen=True)
class ConsumerGroup:
    name: str
    service: str
    topics: tuple[str, ...]


STATE = ConsumerGroup("mars-state", "state", (TOPIC_RECEIVED,))
#: Views read the state topic (whose events carry the turn's embedding when the controller made one).
MEMORY_VIEW = ConsumerGroup("mars-memory-view", "memory", (TOPIC_STATE,))
MEMORY_WRITER = ConsumerGroup("mars-memory-writer", "memory", (TOPIC_GENERATED,))
ROUTER = ConsumerGroup("mars-router", "router", (TOPIC_VIEW,))
ROUTER_UPDATES = ConsumerGroup("mars-router-updates", "router", (TOPIC_JUDGED,))
DISPATCH = ConsumerGroup("mars-dispatch", "dispatch", (TOPIC_ROUTED,))
JUDGE = ConsumerGroup("mars-judge", "judge", (TOPIC_GENERATED, TOPIC_FEEDBACK))
#: Outcomes of turns (answered, failed), from memory's commits which imported pairs are stored, and from
#: the judge's verdicts what each turn cost (the tenant's daily spend, without reading the judge's table).
INGRESS_OUTCOMES = ConsumerGroup(
    "mars-ingress-outcomes",
    "ingress",
    (TOPIC_GENERATED, TOPIC_DEAD_LETTER, TOPIC_MEMORY_COMMITTED, TOPIC_JUDGED),
)

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


def _allow(*callers: str) -> frozenset[str]:
    return frozenset(callers)


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the deployment."""

    name: str
    #: "module:Class" of its settings model (MARS_* variables).
    settings: str
    #: Module whose MIGRATIONS are the tables the service owns (None: only the shared stage ledger).
    schema: str | None
    #: Full name of the gRPC service it serves (readiness asks for it by name).
    grpc_service: str
    groups: tuple[ConsumerGroup, ...]
    #: Method name -> the caller identities allowed (mars.identity). Empty for the ingress, whose callers
    #: are tenants with API keys (mars.auth), not services.
    permissions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: Topics it publishes to (the dead-letter topic besides, which every stage writes): its Kafka
    #: principal may write these and no others (mars.kafka_acls).
    produces: tuple[str, ...] = ()
    #: Topics each of its replicas reads outside any group (broadcast readers: replies, control events).
    broadcast_reads: tuple[str, ...] = ()
    #: Its names in the `stage_emitted` ledger (mars.config *_STAGE): its Postgres role sees only these rows.
    stages: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        """Every topic the service reads, in its groups or broadcast."""
        topics = [t for g in self.groups for t in g.topics] + list(self.broadcast_reads)
        return tuple(dict.fromkeys(topics))

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.produces, TOPIC_DEAD_LETTER)))

    def settings_class(self) -> type[ServiceSettings]:
        cls = _load(self.settings)
        assert issubclass(cls, ServiceSettings)
        return cls

    def migrations(self) -> Sequence[str]:
        """The DDL the service applies at start (besides the shared ledger, which `db.migrate` adds)."""
        if self.schema is None:
            return ()
        return tuple(importlib.import_module(self.schema).MIGRATIONS)


#: Every service, in the order the local stack starts them.
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "state",
        "mars_state.settings:StateSettings",
        "mars_state.schema",
        "mars.v1.StateEstimator",
        (STATE,),
        # ImportContext: the ingress hands over the context a history import leaves (state owns the table).
        {"Estimate": _allow("operator"), "ImportContext": _allow("ingress")},
        produces=(TOPIC_STATE,),
        broadcast_reads=(TOPIC_CONTROL,),
        stages=(STATE_STAGE,),
    ),
    ServiceSpec(
        "memory",
        "mars_memory.settings:MemorySettings",
        "mars_memory.schema",
        "mars.v1.Memory",
        (MEMORY_VIEW, MEMORY_WRITER),
        {"BuildView": _allow("operator"), "DescribeIndex": _allow("operator", "chaos")},
        produces=(TOPIC_VIEW, TOPIC_MEMORY_COMMITTED),
        broadcast_reads=(TOPIC_CONTROL,),
        stages=(MEMORY_VIEW_STAGE, MEMORY_COMMIT_STAGE),
    ),
    ServiceSpec(
        "router",
        "mars_router.settings:RouterSettings",
        "mars_router.schema",
        "mars.v1.Router",
        (ROUTER, ROUTER_UPDATES),
        {
            "Route": _allow("operator"),
            "GetPolicy": _allow("operator", "replay", "deploy"),
            "ResetPolicy": _allow("operator"),
        },
        produces=(TOPIC_ROUTED,),
        # Control: a forgotten user's rows (each owner deletes its own, mars.forget).
        broadcast_reads=(TOPIC_CONTROL,),
        stages=(ROUTER_STAGE,),
    ),
    ServiceSpec(
        "dispatch",
        "mars_dispatch.settings:DispatchSettings",
        None,
        "mars.v1.Dispatch",
        (DISPATCH,),
        {"Generate": _allow("operator"), "ListModels": _allow("operator", "deploy")},
        produces=(TOPIC_GENERATED, TOPIC_TOKENS),
        broadcast_reads=(TOPIC_CONTROL,),
        stages=(DISPATCH_STAGE,),
    ),
    ServiceSpec(
        "judge",
        "mars_judge.settings:JudgeSettings",
        "mars_judge.schema",
        "mars.v1.Judge",
        (JUDGE,),
        {"Score": _allow("operator")},
        produces=(TOPIC_JUDGED,),
        broadcast_reads=(TOPIC_CONTROL,),
        stages=(JUDGE_STAGE,),
    ),
    ServiceSpec(
        "ingress",
        "mars_ingress.settings:IngressSettings",
        "mars_ingress.schema",
        "mars.v1.Ingress",
        (INGRESS_OUTCOMES,),
        # Generated: the answers of an imported history (they go to memory as answered turns do).
        produces=(TOPIC_RECEIVED, TOPIC_FEEDBACK, TOPIC_GENERATED, TOPIC_CONTROL),
        # Each replica reads every reply, streamed token, dead letter and forget (the calls wait there).
        broadcast_reads=(TOPIC_GENERATED, TOPIC_TOKENS, TOPIC_DEAD_LETTER, TOPIC_CONTROL),
        stages=(INGRESS_STAGE,),
    ),
)
NAMES: tuple[str, ...] = tuple(s.name for s in SERVICES)
#: The HTTP gateway's settings model: a deployable too, a caller of the ingress with no stage of its own.
GATEWAY_SETTINGS = "mars_gateway.settings:GatewaySettings"
_BY_NAME = {s.name: s for s in SERVICES}
_GROUPS = {g.name: g for s in SERVICES for g in s.groups}


def _load(path: str) -> type[CallerSettings]:
    module, _, name = path.partition(":")
    cls: type[CallerSettings] = getattr(importlib.import_module(module), name)
    return cls


def deployable_settings() -> dict[str, type[CallerSettings]]:
    """Every deployable's settings model by name: the services' and the gateway's."""
    return {**{s.name: s.settings_class() for s in SERVICES}, "gateway": _load(GATEWAY_SETTINGS)}


def deployable_env_names() -> frozenset[str]:
    """Every MARS_* name some deployable reads, old names included: what a deployable's environment may
    carry for another (mars.config.CallerSettings.check_environment)."""
    return frozenset(n for cls in deployable_settings().values() for n in cls.env_names())


def field_env(field_name: str, value: str) -> dict[str, str]:
    """The environment that sets `field_name` to `value` in every deployable whose model has the field, each
    under its own name (mars.config.env_name): e.g. model_pool for the router, dispatch and the gateway."""
    return {
        env_name(cls, field_name): value
        for cls in deployable_settings().values()
        if field_name in cls.model_fields
    }


def service(name: str) -> ServiceSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown service {name!r}; known: {', '.join(NAMES)}") from None


def group(name: str) -> ConsumerGroup:
    try:
        return _GROUPS[name]
    except KeyError:
        raise ValueError(f"unknown consumer group {name!r}; known: {', '.join(_GROUPS)}") from None


#: Who may call what, by full gRPC method name; a method missing here is refused to everyone.
PERMISSIONS: Mapping[str, frozenset[str]] = {
    f"/{s.grpc_service}/{method}": callers for s in SERVICES for method, callers in s.permissions.items()
}
#: The stage services: every RPC on them needs a caller identity (health and reflection aside).
INTERNAL_SERVICES = frozenset(s.grpc_service for s in SERVICES if s.permissions)
