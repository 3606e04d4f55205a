"""Judge service: turns each generated answer into the Eq. 17 utility and the reward r = u - lambda*C_gen
the router learns from; records explicit user feedback (appendix G.1) beside it."""

from __future__ import annotations

import logging

import grpc
from mars.bus import EventProducer, StageConsumer, StageOutput, Subscription
from mars.config import TOPIC_FEEDBACK, TOPIC_GENERATED, TOPIC_JUDGED, ServiceSettings
from mars.domain.reward import judge_turn
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

STAGE = "judge"

MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS judge_feedback (
        turn_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, user_id TEXT NOT NULL,
        rating DOUBLE PRECISION NOT NULL, comment TEXT NOT NULL, received_at TIMESTAMPTZ NOT NULL DEFAULT now()
    )
    """,
]


class JudgeSettings(ServiceSettings):
    #: Cost weight lambda of Eq. 17 (paper Table 8: 0.002 main RealMem run, 0.5 ablations).
    lambda_cost: float = 0.002


def score(event: ev.Generated, lambda_cost: float) -> ev.Judged:
    judged = judge_turn(
        event.query, event.text, list(event.packed_blocks), event.state, event.cost_usd, lambda_cost
    )
    judged.turn.CopyFrom(event.turn)
    judged.arm = event.model
    judged.policy_id = event.policy_id
    judged.features.extend(event.features)
    judged.failed_arms.extend(a.arm for a in event.attempts if not a.ok)
    return judged


class JudgeStage:
    def __init__(self, settings: JudgeSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._pool = pool
        self._out = StageOutput(pool, producer, STAGE, TOPIC_JUDGED)

    async def on_generated(self, event: ev.Generated) -> None:
        if event.status != ev.OK:
            # No arm answered: there is nothing to reward; the failure stays on the generated event.
            log.info("turn %s failed before judging: %s", event.turn.turn_id, event.error)
            return
        if await self._out.done(event.turn.turn_id):
            return
        await self._out.emit(score(event, self._settings.lambda_cost), event.turn)

    async def on_feedback(self, event: ev.Feedback) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO judge_feedback (turn_id, tenant, user_id, rating, comment) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (turn_id) DO UPDATE SET rating = EXCLUDED.rating, comment = EXCLUDED.comment",
                (event.turn.turn_id, event.turn.tenant, event.turn.user_id, event.rating, event.comment),
            )


class JudgeServicer(svc_grpc.JudgeServicer):
    def __init__(self, settings: JudgeSettings) -> None:
        self._settings = settings

    async def Score(self, request: ev.Generated, context: grpc.aio.ServicerContext) -> ev.Judged:
        if request.status != ev.OK:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "only a successful generation can be judged"
            )
        return score(request, self._settings.lambda_cost)


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, JudgeSettings)
    stage = JudgeStage(settings, ctx.producer, ctx.pool)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        "judge",
        "mars-judge",
        [
            Subscription(TOPIC_GENERATED, ev.Generated, stage.on_generated),
            Subscription(TOPIC_FEEDBACK, ev.Feedback, stage.on_feedback),
        ],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(svc_grpc.add_JudgeServicer_to_server, JudgeServicer(settings), "mars.v1.Judge")
        ],
        consumers=[consumer],
    )


def main() -> None:
    run("judge", JudgeSettings(), build, MIGRATIONS)
