"""Memory service: durable turn pairs and threads in Postgres, and the state-conditioned candidate view
(Eq. 12, Table 6). Writes come off the answer path from the generated-event log; a view for turn n
waits (bounded) until turn n-1 of the same user is applied (read-your-writes)."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from mars import db
from mars.bus import EventProducer, StageConsumer, Subscription
from mars.config import TOPIC_GENERATED, TOPIC_MEMORY_COMMITTED, TOPIC_STATE, TOPIC_VIEW, ServiceSettings
from mars.domain.memory_policy import MemoryRecord, build_view, memory_controls
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

VIEW_STAGE = "memory-view"
COMMIT_STAGE = "memory-commit"

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS memory_threads (
        thread_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        status TEXT NOT NULL, opened_seq BIGINT NOT NULL, title TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS memory_threads_user ON memory_threads (tenant, user_id, status)",
    """
    CREATE TABLE IF NOT EXISTS memory_records (
        record_id TEXT PRIMARY KEY, turn_id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL, user_id TEXT NOT NULL, session_id TEXT NOT NULL, thread_id TEXT NOT NULL,
        seq BIGINT NOT NULL, user_text TEXT NOT NULL, assistant_text TEXT NOT NULL,
        created_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
    "CREATE INDEX IF NOT EXISTS memory_records_user ON memory_records (tenant, user_id, seq)",
    """
    CREATE TABLE IF NOT EXISTS memory_progress (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL, applied_seq BIGINT NOT NULL,
        PRIMARY KEY (tenant, user_id)
    )
    """,
]


class MemorySettings(ServiceSettings):
    #: Longest a view waits for turn n-1 to be applied before it is built and flagged possibly_stale.
    read_your_writes_wait_s: float = 10.0
    #: Records of the user's history considered for retrieval (newest first).
    history_limit: int = 2000
    view_policy: str = "mars"


def _record(row: tuple[object, ...]) -> MemoryRecord:
    return MemoryRecord(
        record_id=str(row[0]),
        session_id=str(row[1]),
        turn_id=str(row[2]),
        seq=int(row[3]),  # type: ignore[call-overload]
        user_text=str(row[4]),
        assistant_text=str(row[5]),
    )


class MemoryStore:
    """Postgres-backed memory of one deployment; every query is scoped to (tenant, user_id)."""

    def __init__(self, pool: AsyncConnectionPool, settings: MemorySettings) -> None:
        self._pool = pool
        self._settings = settings
        self._applied = asyncio.Condition()

    async def applied_seq(self, conn: AsyncConnection, tenant: str, user_id: str) -> int:
        cur = await conn.execute(
            "SELECT applied_seq FROM memory_progress WHERE tenant = %s AND user_id = %s", (tenant, user_id)
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def wait_applied(self, tenant: str, user_id: str, seq: int) -> bool:
        """True once seq is applied; False when the bounded wait ran out."""
        deadline = time.monotonic() + self._settings.read_your_writes_wait_s
        while True:
            async with self._pool.connection() as conn:
                if await self.applied_seq(conn, tenant, user_id) >= seq:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            async with self._applied:
                try:
                    # Woken by a local commit; the timeout covers commits by another replica.
                    await asyncio.wait_for(self._applied.wait(), timeout=min(0.05, remaining))
                except TimeoutError:
                    pass

    async def view(self, tenant: str, user_id: str, text: str, state: ev.SessionState) -> ev.CandidateView:
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT thread_id, title FROM memory_threads WHERE tenant = %s AND user_id = %s AND status = 'ACTIVE'",
                (tenant, user_id),
            )
            active = await cur.fetchone()
            cur = await conn.execute(
                "SELECT record_id, session_id, turn_id, seq, user_text, assistant_text, thread_id "
                "FROM memory_records WHERE tenant = %s AND user_id = %s ORDER BY seq DESC LIMIT %s",
                (tenant, user_id, self._settings.history_limit),
            )
            rows = await cur.fetchall()
        rows.reverse()
        # A NEW_TOPIC turn starts a fresh thread: the old active thread becomes history.
        continuing = active is not None and state.action != ev.NEW_TOPIC
        thread_id = active[0] if continuing and active else None
        recent = [_record(r) for r in rows if r[6] == thread_id]
        history = [_record(r) for r in rows if r[6] != thread_id]
        active_state = None
        if continuing and active:
            active_state = f"Active thread: {active[1]} ({len(recent)} turn(s) so far)."
        return build_view(
            memory_controls(state), text, active_state, recent, history, policy=self._settings.view_policy
        )

    async def commit(self, event: ev.Generated) -> ev.MemoryCommitted:
        """Store the turn pair and advance the user's applied seq, in one transaction (idempotent by turn_id)."""
        turn = event.turn
        out = ev.MemoryCommitted(turn=turn)
        async with self._pool.connection() as conn, conn.transaction():
            # Serialise a user's commits (two replicas during a rebalance, or a redelivery).
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"{turn.tenant}/{turn.user_id}",)
            )
            cur = await conn.execute(
                "SELECT record_id, thread_id FROM memory_records WHERE turn_id = %s", (turn.turn_id,)
            )
            existing = await cur.fetchone()
            if existing is not None:
                out.record_id, out.thread_id, out.stored = existing[0], existing[1], True
            elif event.status == ev.OK:
                cur = await conn.execute(
                    "SELECT thread_id FROM memory_threads WHERE tenant = %s AND user_id = %s AND status = 'ACTIVE'",
                    (turn.tenant, turn.user_id),
                )
                active = await cur.fetchone()
                if active is None or event.state.action == ev.NEW_TOPIC:
                    if active is not None:
                        await conn.execute(
                            "UPDATE memory_threads SET status = 'ARCHIVED' WHERE thread_id = %s", (active[0],)
                        )
                        out.archived_previous_thread = True
                    out.thread_id = uuid.uuid4().hex
                    await conn.execute(
                        "INSERT INTO memory_threads (thread_id, tenant, user_id, status, opened_seq, title) "
                        "VALUES (%s, %s, %s, 'ACTIVE', %s, %s)",
                        (out.thread_id, turn.tenant, turn.user_id, turn.seq, event.query[:200]),
                    )
                else:
                    out.thread_id = active[0]
                out.record_id = uuid.uuid4().hex
                await conn.execute(
                    "INSERT INTO memory_records (record_id, turn_id, tenant, user_id, session_id, thread_id, seq, "
                    "user_text, assistant_text) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (
                        out.record_id,
                        turn.turn_id,
                        turn.tenant,
                        turn.user_id,
                        turn.session_id,
                        out.thread_id,
                        turn.seq,
                        event.query,
                        event.text,
                    ),
                )
                out.stored = True
            # A failed turn stores nothing but still advances seq, so turn n+1 never waits for it.
            await conn.execute(
                """
                INSERT INTO memory_progress (tenant, user_id, applied_seq) VALUES (%s, %s, %s)
                ON CONFLICT (tenant, user_id) DO UPDATE
                SET applied_seq = GREATEST(memory_progress.applied_seq, EXCLUDED.applied_seq)
                """,
                (turn.tenant, turn.user_id, turn.seq),
            )
        async with self._applied:
            self._applied.notify_all()
        return out


class MemoryStage:
    def __init__(self, store: MemoryStore, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._store = store
        self._producer = producer
        self._pool = pool

    async def on_state(self, event: ev.StateEstimated) -> None:
        turn = event.turn
        started = time.perf_counter()
        async with self._pool.connection() as conn:
            if await db.already_emitted(conn, VIEW_STAGE, turn.turn_id):
                return
        fresh = await self._store.wait_applied(turn.tenant, turn.user_id, turn.seq - 1)
        view = await self._store.view(turn.tenant, turn.user_id, event.text, event.state)
        view.possibly_stale = not fresh
        out = ev.ViewBuilt(
            turn=turn,
            text=event.text,
            state=event.state,
            view=view,
            latency_ms=(time.perf_counter() - started) * 1000,
        )
        await self._producer.publish(TOPIC_VIEW, out, turn)
        async with self._pool.connection() as conn:
            await db.mark_emitted(conn, VIEW_STAGE, turn.turn_id)

    async def on_generated(self, event: ev.Generated) -> None:
        turn = event.turn
        committed = await self._store.commit(event)
        async with self._pool.connection() as conn:
            if await db.already_emitted(conn, COMMIT_STAGE, turn.turn_id):
                return
            await self._producer.publish(TOPIC_MEMORY_COMMITTED, committed, turn)
            await db.mark_emitted(conn, COMMIT_STAGE, turn.turn_id)


class MemoryServicer(svc_grpc.MemoryServicer):
    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    async def BuildView(
        self, request: svc.BuildViewRequest, context: grpc.aio.ServicerContext
    ) -> ev.CandidateView:
        if not request.tenant or not request.user_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tenant and user_id are required")
        return await self._store.view(request.tenant, request.user_id, request.text, request.state)


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, MemorySettings)
    store = MemoryStore(ctx.pool, settings)
    stage = MemoryStage(store, ctx.producer, ctx.pool)
    # Two consumers: a view waiting for turn n-1 must never block the commit of turn n-1 behind it.
    views = StageConsumer(
        settings,
        ctx.producer,
        "memory",
        "mars-memory-view",
        [Subscription(TOPIC_STATE, ev.StateEstimated, stage.on_state)],
    )
    writer = StageConsumer(
        settings,
        ctx.producer,
        "memory",
        "mars-memory-writer",
        [Subscription(TOPIC_GENERATED, ev.Generated, stage.on_generated)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(svc_grpc.add_MemoryServicer_to_server, MemoryServicer(store), "mars.v1.Memory")
        ],
        consumers=[views, writer],
    )


def main() -> None:
    run("memory", MemorySettings(), build, MIGRATIONS)
