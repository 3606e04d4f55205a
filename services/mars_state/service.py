"""State service: the QTM step z_t = f(q, H, B). Keeps each user's active context in Postgres and
estimates the Table 5 session state for every received turn through the guarded controller
(`mars_state.qtm`): the learned CPU model (default), an LLM backend (openai / llamacpp / vllm) under a deadline,
or the rules alone."""

from __future__ import annotations

import logging
import os
import time

import grpc
from mars import deadline
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.output import StageOutput
from mars.bus.producer import EventProducer
from mars.config import STATE_STAGE, TOPIC_RECEIVED, TOPIC_STATE
from mars.domain.vectors import encode_vector
from mars.llm_json import TokenPrices, endpoint_url
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, rpc_errors, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_state.context import ContextStore
from mars_state.qtm.controllers import make_controller
from mars_state.qtm.guard import GuardedEstimator
from mars_state.qtm.learned import LearnedController, ModelFileError
from mars_state.settings import StateSettings
from mars_state.spec import ESTIMATES, SPEC

STAGE = STATE_STAGE
log = logging.getLogger(__name__)


def make_estimator(settings: StateSettings) -> GuardedEstimator:
    """The guarded controller of the settings. A learned backend whose model file cannot be loaded leaves
    the rules answering (the estimator's `model_error` says why; the health entry reports it)."""
    url = endpoint_url(settings.qtm_url, settings.qtm_backend, settings.local_llm_url)
    deadline_s = settings.qtm_deadline_ms / 1000
    model_error = ""
    try:
        controller = make_controller(
            settings.qtm_backend,
            base_url=url,
            model=settings.qtm_learned_model if settings.qtm_backend == "learned" else settings.qtm_model,
            prompt=settings.qtm_prompt,
            api_key=os.environ.get(settings.qtm_api_key_env) or None,
            timeout_s=deadline_s + 1.0,
            max_tokens=settings.qtm_max_tokens,
            max_in_flight=settings.qtm_max_in_flight,
            embedding_cache_dir=settings.embedding_cache_dir,
        )
    except ModelFileError as exc:
        log.error("learned QTM model not loaded (%s); the rules answer every turn", exc)
        controller, model_error = None, str(exc)
    pricing = TokenPrices(settings.qtm_price_input_per_m, settings.qtm_price_output_per_m)
    estimator = GuardedEstimator(controller, deadline_s, pricing)
    estimator.model_error = model_error
    return estimator


class StateEstimatorServicer(svc_grpc.StateEstimatorServicer):
    def __init__(self, settings: StateSettings, estimator: GuardedEstimator, contexts: ContextStore) -> None:
        self._settings = settings
        self._estimator = estimator
        self._contexts = contexts

    @rpc_errors
    async def Estimate(
        self, request: svc.EstimateRequest, context: grpc.aio.ServicerContext
    ) -> ev.SessionState:
        if not request.text.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        return await self._estimator.estimate(request.text, list(request.active_context))

    @rpc_errors
    async def ImportContext(
        self, request: svc.ImportContextRequest, context: grpc.aio.ServicerContext
    ) -> svc.ImportContextReply:
        """The context a history import leaves active (the ingress, after recording the pairs' seqs)."""
        if not (request.tenant and request.user_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tenant and user_id are required")
        if request.last_seq < 1 or request.thread_depth < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "last_seq must be at least 1 and thread_depth not negative"
            )
        applied = await self._contexts.save(
            request.tenant,
            request.user_id,
            list(request.recent_texts)[-self._settings.state_context_turns :],
            request.thread_depth,
            request.last_seq,
            request.session_id,
        )
        return svc.ImportContextReply(applied=applied)


class StateStage:
    def __init__(
        self,
        settings: StateSettings,
        producer: EventProducer,
        pool: AsyncConnectionPool,
        estimator: GuardedEstimator,
        contexts: ContextStore,
    ) -> None:
        self._settings = settings
        self._estimator = estimator
        self._contexts = contexts
        self._out = StageOutput(pool, producer, STAGE, TOPIC_STATE)

    async def on_received(self, event: ev.TurnReceived) -> None:
        turn = event.turn
        started = time.perf_counter()
        if await self._out.done(turn.turn_id):
            return
        if deadline.passed(turn, SPEC.name):
            # No controller call and no context saved: the turn fails at dispatch (mars.deadline).
            out = ev.StateEstimated(
                turn=turn, text=event.text, latency_ms=(time.perf_counter() - started) * 1000
            )
            await self._out.emit(out, turn)
            return
        active = await self._contexts.load(turn.tenant, turn.user_id)
        # An imported history may leave more turns than this service's context holds.
        recent = active.recent[-self._settings.state_context_turns :] if active else []
        depth = active.thread_depth if active else 0
        # The first turn of a session after earlier ones (a row from before the column: not known).
        opens_session = (
            active is not None and active.session_id is not None and active.session_id != turn.session_id
        )
        # No connection is held across the controller call (it may take up to the deadline).
        state = await self._estimator.estimate(event.text, recent, opens_session)
        if state.action == ev.NEW_TOPIC:
            recent, depth = [], 0
        depth += 1
        state.thread_depth = depth
        recent = [*recent, event.text][-self._settings.state_context_turns :]
        tag, vector = self._text_embedding(event.text)
        # Guarded by seq so a redelivered older turn cannot roll the context back.
        await self._contexts.save(turn.tenant, turn.user_id, recent, depth, turn.seq, turn.session_id)
        out = ev.StateEstimated(
            turn=turn,
            text=event.text,
            state=state,
            latency_ms=(time.perf_counter() - started) * 1000,
            text_embedding=vector,
            text_embedder=tag,
        )
        await self._out.emit(out, turn)

    def _text_embedding(self, text: str) -> tuple[str, str]:
        """(embedder tag, encoded vector) of the turn's text when the controller embedded it, else ("", "")."""
        controller = self._estimator.controller
        if isinstance(controller, LearnedController):
            vector = controller.cached_embedding(text)
            if vector is not None:
                return controller.embedder_tag, encode_vector(vector)
        return "", ""

    async def on_forgotten(self, event: ev.UserForgotten) -> None:
        """Every replica: the forgotten user's context row is deleted already; their texts may still key
        the controller's embedding cache, which is dropped whole (whose texts they are is not known)."""
        dropped = self._estimator.forget_cached()
        log.info("forget %s: dropped %d cached turn embeddings", event.forget_id, dropped)


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, StateSettings)
    estimator = make_estimator(settings)
    # One store of the table for both writers: the stage (every turn) and ImportContext (imports).
    contexts = ContextStore(ctx.pool)
    stage = StateStage(settings, ctx.producer, ctx.pool, estimator, contexts)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        ESTIMATES,
        [Subscription(TOPIC_RECEIVED, ev.TurnReceived, stage.on_received)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_StateEstimatorServicer_to_server,
                StateEstimatorServicer(settings, estimator, contexts),
                SPEC.grpc_service,
            )
        ],
        consumers=[consumer],
        on_forgotten=stage.on_forgotten,
        # NOT_SERVING while the controller keeps failing: turns still get states, from the rules.
        health_probes={f"{SPEC.grpc_service}.controller": lambda: estimator.healthy},
        # The learned backend's model file did not load: the rules answer instead.
        health=(
            {f"{SPEC.grpc_service}.learned_model": not estimator.model_error}
            if settings.qtm_backend == "learned"
            else {}
        ),
        on_stop=[estimator.aclose],
    )


def main() -> None:
    run(SPEC, build)
