"""`mars migrate` and `mars topics`: the services' own DDL, what a migration reports, topic listings, and
settings errors as one clear line."""

from __future__ import annotations

import mars_ingress.schema
import mars_ingress.service
import mars_judge.schema
import mars_memory.schema
import mars_memory.service
import mars_router.schema
import mars_state.schema
import mars_state.service
import pytest
from mars import topology
from mars.migrations import new_objects, service_migrations
from mars_tools.admin_cli import SettingsError, load_settings, topic_rows
from mars_tools.cli import build_parser


def test_migrate_uses_each_services_own_statements() -> None:
    assert service_migrations("ingress") == tuple(mars_ingress.schema.MIGRATIONS)
    assert service_migrations("memory") == tuple(mars_memory.schema.MIGRATIONS)
    assert service_migrations("router") == tuple(mars_router.schema.MIGRATIONS)
    assert service_migrations("judge") == tuple(mars_judge.schema.MIGRATIONS)
    assert service_migrations("state") == tuple(mars_state.schema.MIGRATIONS)
    assert service_migrations("dispatch") == ()  # only the shared stage_emitted ledger


def test_each_service_applies_at_start_what_mars_migrate_applies() -> None:
    # A service starts from its spec (mars.runtime.run migrates with spec.migrations), the one `mars migrate`
    # reads through mars.topology.
    for module in (mars_ingress.service, mars_memory.service, mars_state.service):
        assert module.SPEC is topology.service(module.SPEC.name)
        assert module.SPEC.migrations is service_migrations(module.SPEC.name)


def test_new_objects_names_new_tables_and_only_the_columns_added_to_old_ones() -> None:
    before = {("table", "a"), ("column", "a.x")}
    after = before | {("table", "b"), ("column", "b.y"), ("column", "a.z"), ("index", "b_y")}
    assert new_objects(before, after) == (("column", "a.z"), ("index", "b_y"), ("table", "b"))
    assert new_objects(after, after) == ()


def test_topic_rows_from_describe_topics() -> None:
    described = [
        {"topic": "p.mars.turn.state", "error_code": 0, "partitions": [{"replicas": [1, 2, 3]}] * 12},
        {"topic": "p.mars.turn.view", "error_code": 3, "partitions": []},  # unknown topic
    ]
    rows = topic_rows(("p.mars.turn.state", "p.mars.turn.view"), described)
    assert rows == [("p.mars.turn.state", "12", "3"), ("p.mars.turn.view", "missing", "")]


def test_bad_settings_are_one_line_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARS_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    with pytest.raises(SettingsError, match="needs MARS_KAFKA_SASL_USERNAME"):
        load_settings()
    monkeypatch.delenv("MARS_KAFKA_SECURITY_PROTOCOL")
    with pytest.raises(SettingsError, match="topic_prefix"):
        load_settings(topic_prefix="bad prefix!")
    assert load_settings(kafka_partitions=None).kafka_partitions == 3  # None: not given, the default


def test_commands_are_registered() -> None:
    parser = build_parser()
    args = parser.parse_args(["migrate", "--postgres-dsn", "postgresql://x/y", "--service", "router"])
    assert args.service == ["router"] and args.postgres_dsn == "postgresql://x/y"
    args = parser.parse_args(["topics", "ensure", "--partitions", "12", "--replication-factor", "3"])
    assert (args.partitions, args.replication_factor) == (12, 3)
    args = parser.parse_args(["deploy", "status", "--release", "prod", "-n", "ml", "--no-lag", "-o", "json"])
    assert (args.release, args.namespace, args.no_lag, args.output) == ("prod", "ml", True, "json")
