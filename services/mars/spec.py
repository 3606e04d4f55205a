"""What a deployable says about itself: its name, settings model, schema, gRPC service, consumer groups, the
topics it writes and reads, who may call it, its ledger stages.

Each deployable package defines its own (`mars_<name>.spec.SPEC`, importing its settings class and its
schema's MIGRATIONS directly); the runtime runs a service from its spec (mars.runtime.run), and mars.topology
gathers every spec, through the `mars.deployables` entry points, for what needs them all (the launcher,
`mars migrate`, Kafka ACLs, Postgres roles, the chart's tests). Group and topic names are before the run's
topic prefix; the topic and stage names themselves are mars.config's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mars.config import TOPIC_DEAD_LETTER, CallerSettings, ServiceSettings


@dataclass(frozen=True)
class ConsumerGroup:
    """A Kafka consumer group of one service and the topics it reads (the service that consumes with it
    defines it, in its spec)."""

    name: str
    service: str
    topics: tuple[str, ...]


def allow(*callers: str) -> frozenset[str]:
    """The caller identities (mars.identity) allowed on a method."""
    return frozenset(callers)


@dataclass(frozen=True)
class ServiceSpec:
    """One stage service of the deployment."""

    name: str
    #: Its settings model (MARS_* variables).
    settings: type[ServiceSettings]
    #: The DDL of the tables it owns, applied at start (the shared stage ledger besides, which db.migrate adds).
    migrations: tuple[str, ...]
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

    def __post_init__(self) -> None:
        strangers = [g.name for g in self.groups if g.service != self.name]
        if strangers:
            raise ValueError(f"{self.name}'s spec lists group(s) of another service: {', '.join(strangers)}")

    @property
    def reads(self) -> tuple[str, ...]:
        """Every topic the service reads, in its groups or broadcast."""
        topics = [t for g in self.groups for t in g.topics] + list(self.broadcast_reads)
        return tuple(dict.fromkeys(topics))

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.produces, TOPIC_DEAD_LETTER)))

    @property
    def method_permissions(self) -> dict[str, frozenset[str]]:
        """Who may call what, by full gRPC method name ("/mars.v1.Router/GetPolicy")."""
        return {f"/{self.grpc_service}/{method}": callers for method, callers in self.permissions.items()}

    @property
    def internal(self) -> bool:
        """Every RPC on it needs a caller identity (health and reflection aside): a stage other services
        and tools call, not the public edge."""
        return bool(self.permissions)


@dataclass(frozen=True)
class GatewaySpec:
    """The HTTP gateway: a deployable too, a caller of the ingress with no stage, group or table of its own."""

    name: str
    settings: type[CallerSettings]


#: A deployable's spec, as the `mars.deployables` entry points give it.
DeployableSpec = ServiceSpec | GatewaySpec
