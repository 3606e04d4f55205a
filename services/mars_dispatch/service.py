"""Generation dispatch service: transport only. The `routed` stage and the Dispatch gRPC API hand turns to
the Dispatcher (dispatcher.py: packing by Eq. 13, arm calls with circuit breakers, fallback with repacking,
generator cost), which calls the endpoints through ModelClients (clients.py)."""

from __future__ import annotations

import functools
import time

import grpc
from mars import deadline
from mars.bus.codec import PoisonEvent
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.output import StageOutput
from mars.bus.producer import EventProducer
from mars.config import DISPATCH_STAGE, TOPIC_GENERATED, TOPIC_ROUTED, TOPIC_TOKENS
from mars.domain.circuit import CircuitBreaker
from mars.domain.turn_options import MAX_TOKENS_LIMIT, InvalidOption, parse_turn_options
from mars.model_pool import ModelPool, load_pool
from mars.runtime import GrpcBinding, InvalidRequest, ServiceContext, ServiceParts, rpc_errors, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_dispatch.clients import ModelClients
from mars_dispatch.dispatcher import Dispatcher
from mars_dispatch.settings import DispatchSettings
from mars_dispatch.spec import GENERATES, SPEC

STAGE = DISPATCH_STAGE
#: Largest max_tokens a turn may ask for (ingress's limit on the option too).


class DispatchStage:
    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: DispatchSettings,
        producer: EventProducer,
        pg: AsyncConnectionPool,
    ) -> None:
        self._dispatcher = dispatcher
        self._settings = settings
        self._producer = producer
        self._out = StageOutput(pg, producer, STAGE, TOPIC_GENERATED)
        self._pool_arms = list(dispatcher.breakers)

    async def on_routed(self, event: ev.Routed) -> None:
        turn = event.turn
        if await self._out.done(turn.turn_id):
            return
        try:
            options = parse_turn_options(turn.options)
        except InvalidOption as exc:
            raise PoisonEvent(str(exc)) from None
        max_tokens = options.max_tokens or self._settings.default_max_tokens
        # Arms this pool has not got (a router on another pool, a foreign event) are skipped.
        arms = [a for a in dict.fromkeys([event.chosen_arm, *event.fallback_order]) if a in self._pool_arms]
        if not arms:
            raise PoisonEvent(
                f"routed event names no arm of this pool (chosen {event.chosen_arm[:100]!r}, "
                f"{len(event.fallback_order)} fallback(s)); the pool has {', '.join(self._pool_arms)}"
            )
        if deadline.passed(turn, SPEC.name):
            # No packing and no model call: the turn fails here and nothing is rewarded (mars.deadline).
            expired = ev.Generated(
                turn=turn,
                status=ev.FAILED,
                query=event.text,
                state=event.state,
                error=deadline.note(SPEC.name),
            )
            expired.controller_cost_usd = event.state.usage.cost_usd
            await self._out.emit(expired, turn)
            return
        on_delta = None
        if options.stream:
            index = 0

            async def on_delta(arm: str, piece: str, restart: bool) -> None:
                nonlocal index
                chunk = ev.TokenChunk(turn=turn, arm=arm, index=index, text=piece, restart=restart)
                index += 1
                await self._producer.publish(TOPIC_TOKENS, chunk, turn)

        out = await self._dispatcher.generate(
            arms,
            event.text,
            event.state,
            event.view,
            max_tokens,
            event.cascade_min_logprob,
            on_delta,
            turn.deadline_ms,
            view_tokens=options.view_tokens,
        )
        out.turn.CopyFrom(turn)
        out.controller_cost_usd = event.state.usage.cost_usd
        out.features.extend(event.features)
        out.policy_id = event.policy_id
        out.propensity = event.propensity
        await self._out.emit(out, turn)


class DispatchServicer(svc_grpc.DispatchServicer):
    def __init__(self, dispatcher: Dispatcher, pool: ModelPool, settings: DispatchSettings) -> None:
        self._dispatcher = dispatcher
        self._pool = pool
        self._settings = settings

    @rpc_errors
    async def Generate(self, request: svc.GenerateRequest, context: grpc.aio.ServicerContext) -> ev.Generated:
        if request.arm not in self._pool.arms:
            raise InvalidRequest(f"unknown arm {request.arm[:100]!r}; known: {self._pool.arms}")
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        if not 0 <= request.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidRequest(f"max_tokens must be in 0..{MAX_TOKENS_LIMIT} (0: the default)")
        remaining = context.time_remaining()
        return await self._dispatcher.generate(
            [request.arm],
            request.text,
            request.state,
            request.view,
            request.max_tokens or self._settings.default_max_tokens,
            deadline_ms=int((time.time() + remaining) * 1000) if remaining is not None else 0,
        )

    @rpc_errors
    async def ListModels(self, request: svc.Empty, context: grpc.aio.ServicerContext) -> svc.ModelList:
        return svc.ModelList(
            models=[
                svc.ModelInfo(
                    name=m.name,
                    context_window=m.context_window,
                    input_budget=m.input_budget,
                    input_price_per_m=m.input_price_per_m,
                    output_price_per_m=m.output_price_per_m,
                    circuit=self._dispatcher.breakers[m.name].state,
                )
                for m in self._pool.models
            ]
        )


def _circuit_closed(breaker: CircuitBreaker) -> bool:
    return breaker.state != "open"


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, DispatchSettings)
    pool_cfg = load_pool(settings.model_pool)
    clients = ModelClients(pool_cfg, settings.retries_per_arm)
    dispatcher = Dispatcher(pool_cfg, clients, settings)
    stage = DispatchStage(dispatcher, settings, ctx.producer, ctx.pool)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        GENERATES,
        [Subscription(TOPIC_ROUTED, ev.Routed, stage.on_routed)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_DispatchServicer_to_server,
                DispatchServicer(dispatcher, pool_cfg, settings),
                SPEC.grpc_service,
            )
        ],
        consumers=[consumer],
        on_stop=[clients.close],
        # One health entry per arm: NOT_SERVING while its circuit is open.
        health_probes={
            f"{SPEC.grpc_service}.arm.{name}": functools.partial(_circuit_closed, breaker)
            for name, breaker in dispatcher.breakers.items()
        },
    )


def main() -> None:
    run(SPEC, build)
