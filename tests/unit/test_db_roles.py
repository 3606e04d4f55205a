"""A Postgres role per service (mars.db_roles), without a database: every table has one owner, every stage
name one service, and the grants say what the roles may do (the refusals themselves are tested against a
real Postgres in tests/integration/test_postgres_roles.py)."""

from __future__ import annotations

import pytest
from mars import db_roles, forget, topology
from mars.config import (
    DISPATCH_STAGE,
    INGRESS_STAGE,
    JUDGE_STAGE,
    MEMORY_COMMIT_STAGE,
    MEMORY_VIEW_STAGE,
    ROUTER_STAGE,
    STATE_STAGE,
)


def test_every_service_table_has_exactly_one_owner() -> None:
    seen: dict[str, str] = {}
    for name in topology.NAMES:
        for table in forget.owned_tables(name):
            assert table not in seen, f"{table} is created by {seen.get(table)} and {name}"
            seen[table] = name
    # Each table is named after its owner (the convention the audit relies on), the API keys aside.
    assert all(table.startswith(owner) or table == "ingress_api_keys" for table, owner in seen.items())
    assert seen["ingress_api_keys"] == "ingress" and seen["judge_rewards"] == "judge"
    assert forget.owner("user_data_keys") == "ingress" and forget.owner("stage_emitted") is None


def test_every_forgotten_table_but_the_ledger_has_an_owner_that_deletes_it() -> None:
    for table in forget.FORGET_TABLES:
        assert table.table == forget.LEDGER or forget.owner(table.table) is not None, table.table


def test_each_stage_name_belongs_to_one_service() -> None:
    stages = [stage for spec in topology.SERVICES for stage in spec.stages]
    assert sorted(stages) == sorted(
        {
            STATE_STAGE,
            MEMORY_VIEW_STAGE,
            MEMORY_COMMIT_STAGE,
            ROUTER_STAGE,
            DISPATCH_STAGE,
            JUDGE_STAGE,
            INGRESS_STAGE,
        }
    )
    assert all(spec.stages for spec in topology.SERVICES)


def test_role_names_are_prefixed_and_checked() -> None:
    assert db_roles.role_name("judge") == "mars_judge"
    assert db_roles.role_name("operator", "prod_eu") == "prod_eu_operator"
    assert set(db_roles.roles()) == {*topology.NAMES, "operator"}
    with pytest.raises(ValueError, match="unknown service"):
        db_roles.role_name("judges")
    for bad in ("Mars", "1mars", "mars-prod", "mars; DROP"):
        with pytest.raises(ValueError, match="role prefix"):
            db_roles.role_name("judge", bad)


def _sql(statements: list) -> list[str]:  # type: ignore[type-arg]
    return [s.as_string(None) for s in statements]


def test_the_operator_is_a_member_of_every_service_role_and_nothing_more() -> None:
    text = _sql(db_roles.role_statements("mars", {"operator": "pw"}))
    grants = [s for s in text if s.startswith("GRANT") and '"mars_operator"' in s]
    assert sorted(grants) == sorted(f'GRANT "mars_{n}" TO "mars_operator"' for n in topology.NAMES)
    assert all("NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS" in s for s in text if "CREATE ROLE" in s)
    assert "ALTER ROLE \"mars_operator\" PASSWORD 'pw'" in text
    # A login without a password given keeps its own (no statement sets one).
    assert not [s for s in text if "PASSWORD" in s and "mars_judge" in s]


def test_grants_give_the_data_keys_to_the_ingress_and_reads_to_the_others() -> None:
    text = _sql(db_roles.grant_statements("mars", {"stage_emitted", "user_data_keys", forget.FORGET_ACKS}))
    assert 'GRANT SELECT, INSERT, DELETE ON "user_data_keys" TO "mars_ingress"' in text
    assert 'GRANT SELECT ON "user_data_keys" TO "mars_judge"' in text
    policies = [s for s in text if s.startswith("CREATE POLICY") and "stage_emitted" in s]
    assert len(policies) == len(topology.NAMES)
    memory = next(p for p in policies if '"mars_memory"' in p)
    assert "stage IN ('memory-view', 'memory-commit')" in memory
    acks = [s for s in text if s.startswith("CREATE POLICY") and forget.FORGET_ACKS in s]
    assert len(acks) == len(topology.NAMES) - 1 and not [s for s in acks if "mars_ingress" in s]
