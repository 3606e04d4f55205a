"""State service: the QTM step z_t = f(q, H, B). Keeps each user's active context in Postgres and
estimates the Table 5 session state for every received turn (rule-based backend for now)."""

from __future__ import annotations

import time

import grpc
from mars.bus import EventProducer, StageConsumer, StageOutput, Subscription
from mars.config import TOPIC_RECEIVED, TOPIC_STATE, ServiceSettings
from mars.domain.state_rules import estimate_state
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

STAGE = "state"

MIGRATIONS = [
    # The active context the controller reads: the user turns of the active thread, newest last.
    """
    CREATE TABLE IF NOT EXISTS state_context (
        tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        recent_texts JSONB NOT NULL, thread_depth INT NOT NULL, last_seq BIGINT NOT NULL,
        PRIMARY KEY (tenant, user_id)
    )
    """,
]


class StateSettings(ServiceSettings):
    #: User turns of the active thread shown to the controller as PREVIOUS ACTIVE CONTEXT.
    context_turns: int = 6


class StateEstimatorServicer(svc_grpc.StateEstimatorServicer):
    async def Estimate(
        self, request: svc.EstimateRequest, context: grpc.aio.ServicerContext
    ) -> ev.SessionState:
        if not request.text.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        return estimate_state(request.text, list(request.active_context))


class StateStage:
    def __init__(self, settings: StateSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._pool = pool
        self._out = StageOutput(pool, producer, STAGE, TOPIC_STATE)

    async def on_received(self, event: ev.TurnReceived) -> None:
        turn = event.turn
        started = time.perf_counter()
        if await self._out.done(turn.turn_id):
            return
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                "SELECT recent_texts, thread_depth, last_seq FROM state_context WHERE tenant = %s AND user_id = %s",
                (turn.tenant, turn.user_id),
            )
            row = await cur.fetchone()
            recent: list[str] = list(row[0]) if row else []
            depth = int(row[1]) if row else 0
            state = estimate_state(event.text, recent)
            if state.action == ev.NEW_TOPIC:
                recent, depth = [], 0
            depth += 1
            state.thread_depth = depth
            recent = [*recent, event.text][-self._settings.context_turns :]
            # Guarded by seq so a redelivered older turn cannot roll the context back.
            await conn.execute(
                """
                INSERT INTO state_context (tenant, user_id, recent_texts, thread_depth, last_seq)
                VALUES (%s, %s, %s, %s, %s)
                ON CONFLICT (tenant, user_id) DO UPDATE
                SET recent_texts = EXCLUDED.recent_texts, thread_depth = EXCLUDED.thread_depth,
                    last_seq = EXCLUDED.last_seq
                WHERE state_context.last_seq < EXCLUDED.last_seq
                """,
                (turn.tenant, turn.user_id, Jsonb(recent), depth, turn.seq),
            )
            out = ev.StateEstimated(
                turn=turn, text=event.text, state=state, latency_ms=(time.perf_counter() - started) * 1000
            )
        await self._out.emit(out, turn)


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, StateSettings)
    stage = StateStage(settings, ctx.producer, ctx.pool)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        "state",
        "mars-state",
        [Subscription(TOPIC_RECEIVED, ev.TurnReceived, stage.on_received)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_StateEstimatorServicer_to_server,
                StateEstimatorServicer(),
                "mars.v1.StateEstimator",
            )
        ],
        consumers=[consumer],
    )


def main() -> None:
    run("state", StateSettings(), build, MIGRATIONS)
