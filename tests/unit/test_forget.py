"""Forgetting a user (mars.forget): every table with a per-user column is listed, the predicates match the
ids the services write, only an admin key of the tenant may call it, and the in-process caches drop the
user."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from mars import auth, db, forget, topology
from mars.auth import PermissionDenied, Principal, StoredKey
from mars.migrations import service_migrations
from mars.retrieval.embedder import LruEmbedder
from mars_ingress import forget_user
from mars_ingress.admission import InvalidTurn, admin_tenant
from mars_router.policy_tables import policy_id_for
from mars_tools.cli import build_parser


def _all_migrations() -> list[str]:
    statements = list(db.SHARED_SCHEMAS)
    for service in topology.NAMES:
        statements += list(service_migrations(service))
    return statements


def test_every_table_with_a_user_column_is_forgotten() -> None:
    columns = forget.migration_columns(_all_migrations())
    tables = {t for t, _ in columns}
    # The parser sees the schema (a guard against a parser that finds nothing and passes vacuously).
    assert {
        "ingress_turns",
        "memory_records",
        "router_arms",
        "stage_emitted",
        "ingress_api_keys",
        "user_data_keys",
    } <= tables
    assert ("memory_records", "user_id") in columns and ("router_decisions", "session_key") in columns
    assert forget.uncovered(columns) == []
    # Every listed table exists in some service's schema (no stale entry).
    assert {t.table for t in forget.FORGET_TABLES} <= tables


def test_a_new_table_with_a_user_column_is_caught() -> None:
    new = "CREATE TABLE IF NOT EXISTS judge_notes (note_id TEXT PRIMARY KEY, tenant TEXT, user_id TEXT)"
    added = "ALTER TABLE some_table ADD COLUMN IF NOT EXISTS turn_id TEXT"
    columns = forget.migration_columns([*_all_migrations(), new, added])
    assert forget.uncovered(columns) == ["judge_notes", "some_table"]


def test_migration_columns_skip_constraints_and_split_outside_parentheses() -> None:
    stmt = (
        "CREATE TABLE IF NOT EXISTS t (a TEXT NOT NULL, b NUMERIC(10, 2), user_id TEXT, "
        "PRIMARY KEY (a, user_id))"
    )
    assert forget.migration_columns([stmt]) == [("t", "a"), ("t", "b"), ("t", "user_id")]


def test_predicates_match_the_ids_the_services_write() -> None:
    values = forget.params("acme", "u1", ["t1"])
    assert values["policy"] == policy_id_for("user", "acme", "u1")
    # The query-embedding policy of the user is a variant of the same id (deleted with it).
    assert policy_id_for("user", "acme", "u1", "query") == values["policy"] + "#query"
    # router_decisions.session_key is tenant/user/session (mars_router.service).
    assert "acme/u1/s1".startswith(values["session_prefix"])
    assert not "acme/u10/s1".startswith(values["session_prefix"])
    statements = dict(forget.delete_statements())
    assert list(statements)[-2:] == ["ingress_api_keys", "user_data_keys"]
    # router_arms references router_policies: deleted first.
    order = list(statements)
    assert order.index("router_arms") < order.index("router_policies")
    sql = forget.turn_ids_sql({"ingress_turns", "judge_rewards"})
    assert (
        sql is not None and "ingress_turns" in sql and "judge_rewards" in sql and "memory_records" not in sql
    )
    assert forget.turn_ids_sql(set()) is None


def test_control_event_is_keyed_like_the_users_turns() -> None:
    from mars.bus.codec import event_key
    from mars.v1 import events_pb2 as ev

    event = forget_user.control_event("acme", "u1")
    assert len(event.forget_id) == 32 and event.forgotten_at_ms > 0
    assert forget_user.event_key("acme", "u1") == event_key(ev.TurnEnvelope(tenant="acme", user_id="u1"))
    assert ev.UserForgotten.FromString(event.SerializeToString()) == event


def test_only_a_tenant_wide_admin_key_of_the_tenant_may_forget() -> None:
    admin = Principal("k1", "acme", None, admin=True)
    assert admin_tenant(admin, "") == "acme"
    assert admin_tenant(admin, "acme") == "acme"
    with pytest.raises(PermissionDenied):
        admin_tenant(admin, "globex")
    with pytest.raises(PermissionDenied):
        admin_tenant(Principal("k2", "acme"), "acme")
    with pytest.raises(PermissionDenied):
        admin_tenant(Principal("k3", "acme", "u1", admin=True), "acme")
    # Auth off (a closed test network): the request names the tenant.
    assert admin_tenant(None, "acme") == "acme"
    with pytest.raises(InvalidTurn):
        admin_tenant(None, "")


def test_verifier_forgets_the_users_keys_only() -> None:
    keys = {name: auth.generate_key().key for name in ("u1", "u2", "tenant")}
    users = {"u1": "u1", "u2": "u2", "tenant": None}
    table = {
        auth.key_id_of(k): StoredKey(auth.key_id_of(k), auth.key_digest(k), "acme", users[n], False, False)
        for n, k in keys.items()
    }
    lookups: list[str] = []

    async def lookup(key_id: str) -> StoredKey | None:
        lookups.append(key_id)
        return table.get(key_id)

    verifier = auth.KeyVerifier(lookup, ttl_s=60.0)

    async def run() -> None:
        for k in keys.values():
            await verifier.verify(k)
        assert verifier.forget_user("acme", "u1") == 1
        del table[auth.key_id_of(keys["u1"])]
        with pytest.raises(auth.Unauthenticated):
            await verifier.verify(keys["u1"])  # looked up again: gone
        await verifier.verify(keys["u2"])
        await verifier.verify(keys["tenant"])
        assert len(lookups) == 4

    asyncio.run(run())


class _CountingEmbedder:
    dim = 2

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        return np.ones((len(texts), 2), dtype=np.float32)


def test_query_cache_forgets_texts() -> None:
    inner = _CountingEmbedder()
    lru = LruEmbedder(inner)  # type: ignore[arg-type]
    lru.encode(["secret", "public"])
    assert lru.forget(["secret", "never seen"]) == 1
    lru.encode(["public"])
    assert inner.calls == 1
    lru.encode(["secret"])
    assert inner.calls == 2


def test_cli_has_forget_user() -> None:
    args = build_parser().parse_args(["forget-user", "acme", "u1", "--postgres-dsn", "postgresql://x"])
    assert (args.tenant, args.user, args.postgres_dsn) == ("acme", "u1", "postgresql://x")
    bad = build_parser().parse_args(["forget-user", "acme", "u/1"])
    assert args.func(bad) == 2


def test_memory_store_drops_the_users_index_and_every_cached_query_vector() -> None:
    """Only the forgotten user's index goes, but the whole query cache does: which cached texts were theirs
    is not known where their index is not loaded (or for a turn asked with remember=false)."""
    from types import SimpleNamespace

    from mars.domain.memory_policy import MemoryRecord
    from mars_memory.settings import MemorySettings
    from mars_memory.store import MemoryStore

    store = MemoryStore(None, MemorySettings(), None)  # type: ignore[arg-type]
    inner = _CountingEmbedder()
    queries = store.embedding.query_embedder = LruEmbedder(inner)  # type: ignore[arg-type]
    queries.encode(["my secret", "their text"])

    def index(text: str) -> object:
        record = MemoryRecord("r-" + text, "s", "t-" + text, 1, text, "answer")
        return SimpleNamespace(records={record.record_id: record}, lock=asyncio.Lock())

    store.indexes.by_user[("acme", "u1")] = index("my secret")  # type: ignore[assignment]
    store.indexes.by_user[("acme", "u2")] = index("their text")  # type: ignore[assignment]

    async def run() -> None:
        assert await store.forget("acme", "u1") == 1
        assert await store.forget("acme", "u1") == 0  # idempotent
        assert await store.forget("other", "u2") == 0

    asyncio.run(run())
    assert set(store.indexes.by_user) == {("acme", "u2")}
    queries.encode(["their text"])
    assert inner.calls == 2  # embedded again
    queries.encode(["my secret"])
    assert inner.calls == 3
