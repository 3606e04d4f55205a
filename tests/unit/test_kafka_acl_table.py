"""The Kafka ACL table (mars.kafka_acls, from mars.topology) and the SASL_SSL broker's properties
(mars_stack.kafka): what each principal is granted, and that nothing else is."""

from __future__ import annotations

from pathlib import Path

import pytest
from mars import topology
from mars.config import ALL_TOPICS, TOPIC_DEAD_LETTER, TOPIC_GENERATED, TOPIC_RECEIVED, Topics
from mars.kafka_acls import OPERATOR, AclBinding, acl_bindings, principals, service_bindings
from mars_stack import kafka


def _ops(bindings: list[AclBinding], resource: str, name: str) -> set[str]:
    return {b.operation for b in bindings if b.resource == resource and b.name == name}


@pytest.mark.parametrize("service", topology.NAMES)
def test_a_service_writes_what_it_produces_and_reads_what_it_consumes_and_nothing_else(service: str) -> None:
    spec = topology.service(service)
    rules = service_bindings(service, Topics(""))
    assert {b.principal for b in rules} == {service}
    assert all(b.pattern == "literal" for b in rules)  # no wildcard, no prefix
    for base in ALL_TOPICS:
        ops = _ops(rules, "topic", base)
        assert ("write" in ops) == (base in spec.writes), (base, ops)
        assert ("read" in ops) == (base in spec.reads), (base, ops)
        assert ops <= {"write", "create", "read", "describe"}
    assert {b.name for b in rules if b.resource == "group"} == {g.name for g in spec.groups}
    assert not [b for b in rules if b.resource == "cluster"]


def test_the_pipeline_s_edges_are_granted() -> None:
    table = acl_bindings(Topics(""))
    assert "write" in _ops(table["ingress"], "topic", TOPIC_RECEIVED)
    assert "write" in _ops(table["dispatch"], "topic", TOPIC_GENERATED)
    assert "write" not in _ops(table["dispatch"], "topic", TOPIC_RECEIVED)
    assert "write" not in _ops(table["judge"], "topic", TOPIC_GENERATED)
    # Every stage writes dead letters; only the ingress reads them.
    assert all("write" in _ops(table[s], "topic", TOPIC_DEAD_LETTER) for s in topology.NAMES)
    assert [s for s in topology.NAMES if "read" in _ops(table[s], "topic", TOPIC_DEAD_LETTER)] == ["ingress"]
    # Every group's topics are readable by its service.
    for group in topology.STAGE_GROUPS:
        for base in group.topics:
            assert "read" in _ops(table[group.service], "topic", base), (group.name, base)


def test_a_prefixed_run_grants_its_own_names_only() -> None:
    table = acl_bindings(Topics("run7."))
    names = {b.name for rules in table.values() for b in rules if b.resource == "topic"}
    assert all(n.startswith("run7.") for n in names)
    groups = {b.name for b in table["router"] if b.resource == "group"}
    assert groups == {"run7.mars-router", "run7.mars-router-updates"}
    (operator_topics,) = [b for b in table[OPERATOR] if b.resource == "topic"]
    assert (operator_topics.name, operator_topics.pattern) == ("run7.mars.", "prefixed")
    assert set(table) == set(principals())


def test_a_sasl_ssl_broker_has_no_plaintext_listener_and_denies_by_default(tmp_path: Path) -> None:
    security = kafka.BrokerSecurity(
        users={"ingress": "pw-1", "operator": "pw-2"},
        admin_password="adm",
        keystore=tmp_path / "k.pem",
        internal_port=7,
    )
    props = dict(
        line.split("=", 1)
        for line in kafka.server_properties(tmp_path, 9092, 9093, 3, security=security).splitlines()
    )
    assert (
        props["listeners"] == "SASL_SSL://127.0.0.1:9092,INTERNAL://127.0.0.1:7,CONTROLLER://127.0.0.1:9093"
    )
    assert "PLAINTEXT:PLAINTEXT" not in props["listener.security.protocol.map"]
    assert props["listener.name.sasl_ssl.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin"
    assert kafka.scram_format_args(security) == [
        "--add-scram",
        "SCRAM-SHA-512=[name=ingress,password=pw-1]",
        "--add-scram",
        "SCRAM-SHA-512=[name=operator,password=pw-2]",
    ]


def test_logins_that_would_break_the_broker_config_are_refused(tmp_path: Path) -> None:
    bad = kafka.BrokerSecurity(
        users={"ingress": 'a"b'}, admin_password="adm", keystore=tmp_path / "k.pem", internal_port=7
    )
    with pytest.raises(ValueError, match="URL-safe"):
        kafka.server_properties(tmp_path, 9092, 9093, 3, security=bad)
    assert all(c.isalnum() or c in "-_" for c in kafka.new_password())


def test_a_broadcast_reader_the_topology_does_not_list_fails_at_start() -> None:
    """A reader outside any group must be in the topology too: its principal may read nothing else."""
    from mars.bus.consumer import check_broadcast
    from mars.bus.delivery import Subscription
    from mars.config import TOPIC_CONTROL, TOPIC_TOKENS
    from mars.v1 import events_pb2 as ev

    async def handler(event: object) -> None:  # pragma: no cover - never called
        pass

    control = [Subscription(TOPIC_CONTROL, ev.UserForgotten, handler, requires_envelope=False)]
    check_broadcast(topology.service("memory"), control)
    tokens = [Subscription(TOPIC_TOKENS, ev.TokenChunk, handler)]
    check_broadcast(topology.service("ingress"), tokens)  # each ingress replica reads the streamed tokens
    with pytest.raises(ValueError, match="outside its groups"):
        check_broadcast(topology.service("judge"), tokens)


def test_the_charts_acl_file_is_this_table() -> None:
    """One definition: the chart's KafkaUsers carry the file `make chart-acls` writes from this module."""
    from mars.kafka_acls import chart_table_json

    path = Path(__file__).resolve().parents[2] / "charts" / "mars" / "files" / "kafka-acls.json"
    assert path.read_text() == chart_table_json(), "charts/mars/files/kafka-acls.json is stale: make chart-acls"
