"""Kafka principals and what each may do, from the topology (mars.topology): every service logs in to the
broker as its own principal (`User:<service>`), which may write only the topics the service produces (and
the dead-letter topic), read only the topics it consumes, join only its own consumer groups, and see the
run's topic names (its start checks they exist). `operator` is the tools' principal (topics, replay,
redrive, deploy status, the local stack and its harnesses): everything on the run's topics and any group.

`acl_bindings` is the whole table (the local broker's StandardAuthorizer gets it at start, the chart's
KafkaUsers the same); `create_acls` sends it with the Kafka protocol (CreateAcls, API key 30).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.admin import CreateAclsRequest_v1
from aiokafka.protocol.api import Request

from mars import topology
from mars.config import ALL_TOPICS, Topics

#: The tools' principal (not a service): everything on the run's topics, any consumer group.
OPERATOR = "operator"


def principals() -> tuple[str, ...]:
    """Every principal the broker knows besides its own super user: the services and the operator."""
    return (*topology.NAMES, OPERATOR)


# Kafka's protocol codes (org.apache.kafka.common.resource / acl).
_RESOURCE = {"topic": 2, "group": 3, "cluster": 4}
_PATTERN = {"literal": 3, "prefixed": 4}
_OPERATION = {"all": 2, "read": 3, "write": 4, "create": 5, "describe": 8}
_ALLOW = 3


@dataclass(frozen=True)
class AclBinding:
    """One allow rule: `principal` (a name of principals()) may do `operation` on the resource."""

    principal: str
    resource: str  # topic, group or cluster
    name: str
    operation: str  # read, write, create, describe or all
    pattern: str = "literal"  # or prefixed

    def wire(self) -> tuple[int, str, int, str, str, int, int]:
        """As CreateAcls v1 carries it: from any host."""
        return (
            _RESOURCE[self.resource],
            self.name,
            _PATTERN[self.pattern],
            f"User:{self.principal}",
            "*",
            _OPERATION[self.operation],
            _ALLOW,
        )


def service_bindings(service: str, topics: Topics) -> list[AclBinding]:
    """What `service`'s principal may do in the run whose topic names `topics` gives. Read and write imply
    describe; describe alone on the other topics lets its start see that they exist (no data)."""
    spec = topology.service(service)
    out: list[AclBinding] = []
    for base in spec.writes:
        out += [
            AclBinding(service, "topic", topics.name(base), "write"),
            AclBinding(service, "topic", topics.name(base), "create"),
        ]
    out += [AclBinding(service, "topic", topics.name(base), "read") for base in spec.reads]
    covered = {*spec.writes, *spec.reads}
    out += [
        AclBinding(service, "topic", topics.name(base), "describe")
        for base in ALL_TOPICS
        if base not in covered
    ]
    out += [AclBinding(service, "group", topics.prefix + g.name, "read") for g in spec.groups]
    return out


def operator_bindings(topics: Topics) -> list[AclBinding]:
    """The tools' principal: all on the run's topics (a prefixed run: its prefix only) and on any group."""
    return [
        AclBinding(OPERATOR, "topic", topics.prefix + "mars.", "all", "prefixed"),
        AclBinding(OPERATOR, "group", "*", "all"),
        AclBinding(OPERATOR, "cluster", "kafka-cluster", "describe"),
    ]


def acl_bindings(topics: Topics, services: Iterable[str] | None = None) -> dict[str, list[AclBinding]]:
    """Principal -> its allow rules, for the run with topic names `topics` (every service's, or those of
    `services`)."""
    table = {s: service_bindings(s, topics) for s in (topology.NAMES if services is None else services)}
    table[OPERATOR] = operator_bindings(topics)
    return table


def chart_table() -> dict[str, list[dict[str, Any]]]:
    """The table as the chart's KafkaUsers carry it (charts/mars/files/kafka-acls.json, written by `make
    chart-acls`): principal -> Strimzi ACL rules, names before the release's topic prefix (the chart puts
    it in front, as `acl_bindings` does here), operations merged per resource."""
    out: dict[str, list[dict[str, Any]]] = {}
    for principal, rules in acl_bindings(Topics("")).items():
        merged: dict[tuple[str, str, str], list[str]] = {}
        for b in rules:
            merged.setdefault((b.resource, b.name, b.pattern), []).append(b.operation.capitalize())
        out[principal] = [
            # Strimzi says "prefix" where Kafka says PREFIXED.
            {
                "type": resource,
                "name": name,
                "patternType": "prefix" if pattern == "prefixed" else pattern,
                "operations": sorted(set(ops)),
            }
            for (resource, name, pattern), ops in merged.items()
        ]
    return out


def chart_table_json() -> str:
    import json

    return json.dumps(chart_table(), indent=2, sort_keys=True) + "\n"


class _CreateAcls(Request[CreateAclsRequest_v1]):
    """CreateAcls v1 with many creations in one request (aiokafka's CreateAclsRequest carries one)."""

    API_KEY = 30

    def __init__(self, creations: list[tuple[int, str, int, str, str, int, int]]) -> None:
        self._creations = creations

    def build(self, request_struct_class: type[CreateAclsRequest_v1]) -> CreateAclsRequest_v1:
        return request_struct_class(self._creations)


class AclsRefused(RuntimeError):
    pass


async def create_acls(kafka: Mapping[str, Any], bindings: Iterable[AclBinding]) -> int:
    """Create the rules on the broker (existing ones are kept: creating a rule twice is a no-op there).
    `kafka`: client options of a principal allowed to alter ACLs (the broker's super user). The number
    created; AclsRefused naming the first rule the broker refused."""
    wanted = list(dict.fromkeys(bindings))
    if not wanted:
        return 0
    admin = AIOKafkaAdminClient(**kafka)
    await admin.start()
    try:
        response = await admin._send_to_controller(_CreateAcls([b.wire() for b in wanted]))
    finally:
        await admin.close()
    for binding, (code, message) in zip(wanted, response.creation_responses, strict=True):
        if code:
            raise AclsRefused(f"the broker refused {binding}: {message or for_code(code).__name__}")
    return len(wanted)


__all__ = [
    "OPERATOR",
    "AclBinding",
    "AclsRefused",
    "acl_bindings",
    "chart_table",
    "chart_table_json",
    "create_acls",
    "operator_bindings",
    "principals",
    "service_bindings",
]
