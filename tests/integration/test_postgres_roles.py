"""A Postgres role per service, against a real Postgres (the local stack's, roles on as by default): each
service's role is refused on every table another service owns, sees and writes only its own stages' rows
of the shared ledger, may read but not make data keys (the ingress aside), acknowledges a forget as itself
only; the operator (the tools) can do what the services can and create no role; and a service starting as
its role applies its own schema without touching the shared tables."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import pytest
from mars import db, db_roles, forget, topology
from mars_ingress import forget_user
from mars_stack import LocalStack, StackSettings
from psycopg import errors

pytestmark = pytest.mark.integration


#: A work directory deeper than a unix socket's path may be (107 bytes) below pgdata: the server listens on
#: TCP only, so it starts there all the same.
DEEP = "a-work-directory-deeper-than-a-unix-socket-path-may-be-" * 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = LocalStack(
        StackSettings(
            workdir=tmp_path_factory.mktemp("pgroles") / DEEP,
            start_llm=False,
            start_broker=False,
            services=(),
            tenant="",
            postgres_roles=True,
        )
    ).start()
    try:
        yield s
    finally:
        s.stop()


def connect(stack: LocalStack, login: str) -> psycopg.Connection:
    return psycopg.connect(stack.postgres_dsn(login), autocommit=True, connect_timeout=10)


def test_each_role_is_refused_on_every_table_another_service_owns(stack: LocalStack) -> None:
    owned = {name: forget.owned_tables(name) for name in topology.NAMES}
    for name in topology.NAMES:
        with connect(stack, name) as conn:
            assert conn.execute("SELECT current_user").fetchone() == (db_roles.role_name(name),)
            for table in owned[name]:
                conn.execute(f"SELECT count(*) FROM {table}")  # its own: allowed
            for other, tables in owned.items():
                # The forget acknowledgements: each service may add its own, under a row policy (below).
                for table in [t for t in tables if t != forget.FORGET_ACKS] if other != name else ():
                    with pytest.raises(errors.InsufficientPrivilege, match="permission denied"):
                        conn.execute(f"SELECT 1 FROM {table} LIMIT 1")
                    with pytest.raises(errors.InsufficientPrivilege):
                        conn.execute(f"DELETE FROM {table}")


def test_the_stage_ledger_shows_and_takes_only_a_roles_own_stages(stack: LocalStack) -> None:
    for spec in topology.SERVICES:
        with connect(stack, spec.name) as conn:
            db_rows = [(stage, f"ledger-{spec.name}") for stage in spec.stages]
            conn.execute(
                "INSERT INTO stage_emitted (stage, turn_id) VALUES " + ", ".join(["(%s, %s)"] * len(db_rows)),
                [v for row in db_rows for v in row],
            )
            other = next(s for s in topology.SERVICES if s.name != spec.name).stages[0]
            with pytest.raises(errors.InsufficientPrivilege, match="row-level security"):
                conn.execute("INSERT INTO stage_emitted (stage, turn_id) VALUES (%s, 'forged')", (other,))
    for spec in topology.SERVICES:
        with connect(stack, spec.name) as conn:
            seen = {r[0] for r in conn.execute("SELECT DISTINCT stage FROM stage_emitted").fetchall()}
            assert seen == set(spec.stages)
            # Another stage's rows cannot be deleted either: they are not there for this role.
            assert (
                conn.execute(
                    "DELETE FROM stage_emitted WHERE stage <> ALL(%s)", (list(spec.stages),)
                ).rowcount
                == 0
            )
    with connect(stack, "operator") as conn:
        stages = {r[0] for r in conn.execute("SELECT DISTINCT stage FROM stage_emitted").fetchall()}
    assert stages == {s for spec in topology.SERVICES for s in spec.stages}


def test_only_the_ingress_makes_data_keys_and_every_service_reads_them(stack: LocalStack) -> None:
    insert = "INSERT INTO user_data_keys (key_id, tenant, user_id, wrapped) VALUES (%s, 't', %s, '\\x00')"
    with connect(stack, "ingress") as conn:
        conn.execute(insert, ("k-ingress", "u-ingress"))
    for name in topology.NAMES:
        with connect(stack, name) as conn:
            assert conn.execute(
                "SELECT count(*) FROM user_data_keys WHERE key_id = 'k-ingress'"
            ).fetchone() == (1,)
            if name != "ingress":
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute(insert, (f"k-{name}", f"u-{name}"))
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute("DELETE FROM user_data_keys")
                with pytest.raises(errors.InsufficientPrivilege):
                    conn.execute("UPDATE user_data_keys SET wrapped = '\\x01'")


def test_a_service_acknowledges_a_forget_as_itself_only(stack: LocalStack) -> None:
    async def ack(login: str, service: str, counts: dict[str, int]) -> None:
        async with await psycopg.AsyncConnection.connect(stack.postgres_dsn(login), autocommit=True) as conn:
            await forget.acknowledge(conn, "f-1", service, counts)

    asyncio.run(ack("memory", "memory", {"memory_records": 2}))
    asyncio.run(ack("memory", "memory", {"memory_records": 1, "stage_emitted": 3}))  # a second replica
    with pytest.raises(errors.InsufficientPrivilege, match="row-level security"):
        asyncio.run(ack("memory", "judge", {"judge_rewards": 0}))
    with connect(stack, "judge") as conn:  # another service's acknowledgement is not there for it
        assert conn.execute(f"SELECT count(*) FROM {forget.FORGET_ACKS}").fetchone() == (0,)

    async def read() -> dict[str, dict[str, int]]:
        async with await psycopg.AsyncConnection.connect(stack.postgres_dsn("ingress"), autocommit=True) as c:
            return await forget_user.acknowledged(c, "f-1")

    assert asyncio.run(read()) == {"memory": {"memory_records": 3, "stage_emitted": 3}}


def test_each_owner_forgets_its_own_rows_of_a_user(stack: LocalStack) -> None:
    with connect(stack, "admin") as conn:
        conn.execute(
            "INSERT INTO judge_rewards (turn_id, tenant, user_id, arm, policy_id, judge_utility, cost_usd, "
            "lambda_cost, applied_reward) VALUES ('t-9', 'ft', 'gone', 'a', 'p', 1, 0, 0, 1), "
            "('t-8', 'ft', 'kept', 'a', 'p', 1, 0, 0, 1)"
        )
        conn.execute(
            "INSERT INTO stage_emitted (stage, turn_id) VALUES ('judge', 't-9'), ('router', 't-9'), "
            "('judge', 't-8')"
        )

    async def forget_as(service: str) -> dict[str, int]:
        async with await psycopg.AsyncConnection.connect(
            stack.postgres_dsn(service), autocommit=True
        ) as conn:
            counts, _ = await forget.forget_own_async(conn, service, "ft", "gone", forget_id="f-2")
            return counts

    assert asyncio.run(forget_as("judge")) == {"stage_emitted": 1, "judge_feedback": 0, "judge_rewards": 1}
    with connect(stack, "admin") as conn:
        left = conn.execute(
            "SELECT stage, turn_id FROM stage_emitted WHERE turn_id IN ('t-8', 't-9')"
        ).fetchall()
        assert sorted(left) == [("judge", "t-8"), ("router", "t-9")]  # the router's row is the router's
        acked = conn.execute(f"SELECT service FROM {forget.FORGET_ACKS} WHERE forget_id = 'f-2'").fetchall()
    assert acked == [("judge",)]

    # The router deletes its row once it reads the event (the turn ids travel in it).
    async def router_forgets() -> dict[str, int]:
        async with await psycopg.AsyncConnection.connect(
            stack.postgres_dsn("router"), autocommit=True
        ) as conn:
            counts, _ = await forget.forget_own_async(conn, "router", "ft", "gone", ["t-9"], forget_id="f-2")
            return counts

    assert asyncio.run(router_forgets())["stage_emitted"] == 1


def test_the_operator_reads_everything_and_creates_no_role(stack: LocalStack) -> None:
    with connect(stack, "operator") as conn:
        for name in topology.NAMES:
            for table in forget.owned_tables(name):
                conn.execute(f"SELECT count(*) FROM {table}")
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("CREATE ROLE intruder")


def test_a_service_starting_as_its_role_applies_its_schema_and_leaves_the_shared_tables(
    stack: LocalStack,
) -> None:
    async def start_as(service: str) -> None:
        async with await psycopg.AsyncConnection.connect(
            stack.postgres_dsn(service), autocommit=True
        ) as conn:
            await db.migrate_on(conn, topology.service(service).migrations)

    for name in topology.NAMES:
        asyncio.run(start_as(name))
    with connect(stack, "admin") as conn:
        owners = dict(
            conn.execute(
                "SELECT tablename, tableowner FROM pg_tables WHERE schemaname = current_schema()"
            ).fetchall()
        )
    for name in topology.NAMES:
        for table in forget.owned_tables(name):
            assert owners[table] == db_roles.role_name(name), table
    assert owners["stage_emitted"] == owners["user_data_keys"] == "mars"


def test_postgres_runs_in_a_deep_work_directory_and_listens_on_tcp_only(stack: LocalStack) -> None:
    pgdata = stack.workdir / "pgdata"
    assert len(str(pgdata / ".s.PGSQL.65535")) > 107  # where the socket used to be: too long to bind
    assert not list(pgdata.glob(".s.PGSQL.*")), "a unix socket was made"
    with psycopg.connect(stack.env["MARS_POSTGRES_DSN"]) as conn:
        assert conn.execute("SHOW unix_socket_directories").fetchone() == ("",)
