"""Judge service: turns each generated answer into the Eq. 17 utility and the reward r = u - lambda*C_gen
the router learns from; records explicit user feedback (appendix G.1) beside it."""

from __future__ import annotations

import logging
import math
import os

import grpc
from mars import metrics
from mars.bus.codec import PoisonEvent
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.output import StageOutput
from mars.bus.producer import EventProducer
from mars.config import JUDGE_STAGE, TOPIC_FEEDBACK, TOPIC_GENERATED, TOPIC_JUDGED
from mars.db import pg_text
from mars.domain.feedback import feedback_utility
from mars.llm_json import Dialect, JsonChatClient, TokenPrices, endpoint_url
from mars.runtime import GrpcBinding, InvalidRequest, ServiceContext, ServiceParts, rpc_errors, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_judge.rubric.judge import RubricJudge
from mars_judge.settings import JudgeSettings
from mars_judge.spec import SCORES, SPEC

log = logging.getLogger(__name__)

STAGE = JUDGE_STAGE


def make_judge(settings: JudgeSettings) -> RubricJudge:
    client = None
    if settings.judge_backend != "deterministic":
        url = endpoint_url(settings.judge_url, settings.judge_backend, settings.local_llm_url)
        if not url:
            raise ValueError(f"the {settings.judge_backend} judge needs an endpoint (MARS_JUDGE_URL)")
        dialect: Dialect = "llamacpp" if settings.judge_backend == "llamacpp" else "openai"
        client = JsonChatClient(
            url,
            settings.judge_model,
            dialect,
            os.environ.get(settings.judge_api_key_env) or None,
            timeout_s=settings.judge_deadline_ms / 1000 + 1,
            max_tokens=settings.judge_max_tokens,
        )
    return RubricJudge(
        client,
        settings.judge_profile,
        settings.judge_prompt,
        settings.judge_deadline_ms / 1000,
        TokenPrices(settings.judge_price_input_per_m, settings.judge_price_output_per_m),
    )


def generation_problem(event: ev.Generated) -> str | None:
    """Why a generated event cannot be rewarded (its costs make the reward NaN or infinite), or None."""
    for name in ("cost_usd", "controller_cost_usd"):
        value = getattr(event, name)
        if not math.isfinite(value) or value < 0:
            return f"{name} must be a finite number >= 0, got {value}"
    if not math.isfinite(event.state.usage.cost_usd) or event.state.usage.cost_usd < 0:
        return f"state.usage.cost_usd must be a finite number >= 0, got {event.state.usage.cost_usd}"
    return None


async def score(event: ev.Generated, judge: RubricJudge, lambda_cost: float) -> ev.Judged:
    judged = await judge.score(event, lambda_cost)
    judged.turn.CopyFrom(event.turn)
    judged.arm = event.model
    judged.policy_id = event.policy_id
    judged.features.extend(event.features)
    judged.failed_arms.extend(a.arm for a in event.attempts if not a.ok)
    judged.controller_cost_usd = event.state.usage.cost_usd
    return judged


def count_costs(judged: ev.Judged) -> None:
    """Totals per tenant by component (mars.cost.usd): generator, controller (QTM) and judge. Per user
    they are SUMs over judge_rewards: a user label would make one series per user."""
    tenant = judged.turn.tenant
    metrics.record_cost(tenant, "generator", judged.cost_usd)
    metrics.record_cost(tenant, "controller", judged.controller_cost_usd)
    metrics.record_cost(tenant, "judge", judged.judge_cost_usd)


class JudgeStage:
    def __init__(
        self, settings: JudgeSettings, producer: EventProducer, pool: AsyncConnectionPool, judge: RubricJudge
    ) -> None:
        self._settings = settings
        self._judge = judge
        self._pool = pool
        self._producer = producer
        self._out = StageOutput(pool, producer, STAGE, TOPIC_JUDGED)

    async def on_generated(self, event: ev.Generated) -> None:
        if event.imported:
            return  # recorded history (Ingress.ImportHistory): no route was taken, nothing to reward
        if event.status != ev.OK:
            # No arm answered: there is nothing to reward; the failure stays on the generated event.
            log.info("turn %s failed before judging: %s", event.turn.turn_id, event.error)
            return
        turn = event.turn
        if (problem := generation_problem(event)) is not None:
            raise PoisonEvent(problem)
        if await self._out.done(turn.turn_id):
            return
        judged = await score(event, self._judge, self._settings.lambda_for(turn.tenant))
        judged.reward_source = "judge"
        mode = self._settings.feedback_mode_for(turn.tenant)
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT rating FROM judge_feedback WHERE turn_id = %s", (turn.turn_id,))
            row = await cur.fetchone()
            if row is not None and mode != "log":
                # Feedback came before the judge: the first reward already includes it.
                rating = float(row[0])
                utility = feedback_utility(mode, judged.utility, rating, self._settings.feedback_blend_weight)
                judged.reward = utility - judged.lambda_cost * judged.cost_usd
                judged.reward_source = "feedback" if mode == "replace" else "blend"
                judged.feedback_rating = rating
            cur = await conn.execute(
                """
                INSERT INTO judge_rewards (turn_id, tenant, user_id, arm, policy_id, judge_utility, cost_usd,
                                           lambda_cost, applied_reward, controller_cost_usd, judge_cost_usd)
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (turn_id) DO NOTHING
                RETURNING turn_id
                """,
                (
                    turn.turn_id,
                    turn.tenant,
                    turn.user_id,
                    judged.arm,
                    judged.policy_id,
                    judged.utility,
                    judged.cost_usd,
                    judged.lambda_cost,
                    judged.reward,
                    judged.controller_cost_usd,
                    judged.judge_cost_usd,
                ),
            )
            first_time = await cur.fetchone() is not None
        await self._out.emit(judged, turn)
        if first_time:
            count_costs(judged)

    async def on_feedback(self, event: ev.Feedback) -> None:
        """Record the rating; when the turn was already rewarded and the tenant's mode lets feedback count,
        emit a correction by the difference between the new and the applied reward (inside the same
        transaction, so a redelivery recomputes the same correction id and the router applies it once)."""
        turn = event.turn
        if not 0.0 <= event.rating <= 1.0:  # NaN fails too
            raise PoisonEvent(f"feedback rating must be in [0, 1], got {event.rating}")
        mode = self._settings.feedback_mode_for(turn.tenant)
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO judge_feedback (turn_id, tenant, user_id, rating, comment) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (turn_id) DO UPDATE SET rating = EXCLUDED.rating, comment = EXCLUDED.comment",
                (turn.turn_id, turn.tenant, turn.user_id, event.rating, pg_text(event.comment)),
            )
            if mode == "log":
                return
            cur = await conn.execute(
                "SELECT arm, policy_id, judge_utility, cost_usd, lambda_cost, applied_reward, corrections "
                "FROM judge_rewards WHERE turn_id = %s FOR UPDATE",
                (turn.turn_id,),
            )
            row = await cur.fetchone()
            if row is None:
                return  # not judged yet: the judge will fold the rating into the first reward
            arm, policy_id, judge_utility, cost, lam, applied, corrections = row
            utility = feedback_utility(
                mode, float(judge_utility), event.rating, self._settings.feedback_blend_weight
            )
            target = utility - float(lam) * float(cost)
            delta = target - float(applied)
            if abs(delta) < 1e-12:
                return  # the same rating again changes nothing
            correction = ev.Judged(
                turn=turn,
                arm=str(arm),
                policy_id=str(policy_id),
                utility=utility,
                cost_usd=float(cost),
                lambda_cost=float(lam),
                reward=target,
                correction=True,
                reward_delta=delta,
                correction_id=f"{turn.turn_id}#feedback-{int(corrections) + 1}",
                reward_source="feedback" if mode == "replace" else "blend",
                feedback_rating=event.rating,
                judge="feedback",
            )
            await self._producer.publish(TOPIC_JUDGED, correction, turn)
            await conn.execute(
                "UPDATE judge_rewards SET applied_reward = %s, corrections = corrections + 1 WHERE turn_id = %s",
                (target, turn.turn_id),
            )


class JudgeServicer(svc_grpc.JudgeServicer):
    def __init__(self, settings: JudgeSettings, judge: RubricJudge) -> None:
        self._settings = settings
        self._judge = judge

    @rpc_errors
    async def Score(self, request: ev.Generated, context: grpc.aio.ServicerContext) -> ev.Judged:
        if request.status != ev.OK:
            raise InvalidRequest("only a successful generation can be judged")
        if (problem := generation_problem(request)) is not None:
            raise InvalidRequest(problem)
        return await score(request, self._judge, self._settings.lambda_for(request.turn.tenant))


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, JudgeSettings)
    judge = make_judge(settings)
    stage = JudgeStage(settings, ctx.producer, ctx.pool, judge)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        SCORES,
        [
            Subscription(TOPIC_GENERATED, ev.Generated, stage.on_generated),
            Subscription(TOPIC_FEEDBACK, ev.Feedback, stage.on_feedback),
        ],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(svc_grpc.add_JudgeServicer_to_server, JudgeServicer(settings, judge), SPEC.grpc_service)
        ],
        consumers=[consumer],
        # NOT_SERVING while the rubric judge keeps failing (turns are then judged deterministically).
        health_probes={f"{SPEC.grpc_service}.rubric": lambda: judge.healthy},
        on_stop=[judge.aclose],
    )


def main() -> None:
    run(SPEC, build)
