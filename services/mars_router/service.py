"""Router service: features x_t = phi(z, c~, q), LinUCB arm choice (Eq. 15), and the online update
(Eq. 11/16) applied exactly once per judged turn_id. Policy matrices live in Postgres (mars_router.store,
with mars_router.policy_tables and mars_router.rewards); this module is the transport: the Kafka stages and
the gRPC servicer.

With `MARS_ROUTER_POLICY_UPDATES=false` the policy is frozen (the paper's "No online update" ablation,
mars_full_no_update): the router still routes with its current matrices and still consumes and checks
judged events, but never changes A or b, so the policy version does not move either."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from mars import deadline, metrics
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.output import StageOutput
from mars.bus.producer import EventProducer
from mars.config import ROUTER_STAGE, TOPIC_CONTROL, TOPIC_JUDGED, TOPIC_ROUTED, TOPIC_VIEW
from mars.domain.bandits import draw_key
from mars.domain.policy_versions import DEFAULT_VERSION
from mars.model_pool import ModelPool, load_pool
from mars.runtime import GrpcBinding, InvalidRequest, ServiceContext, ServiceParts, check_ids, rpc_errors, run
from mars.telemetry import step
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_router.policy_tables import PolicyCorrupt
from mars_router.settings import RouterSettings
from mars_router.spec import ROUTES, SPEC, UPDATES
from mars_router.store import PolicyStore, ShadowResult
from mars_router.versions import VersionPolicy

log = logging.getLogger(__name__)

STAGE = ROUTER_STAGE


class RouterStage:
    def __init__(
        self,
        store: PolicyStore,
        pool_cfg: ModelPool,
        producer: EventProducer,
        pg: AsyncConnectionPool,
        settings: RouterSettings,
    ) -> None:
        self._store = store
        self._pool_cfg = pool_cfg
        self._settings = settings
        self._out = StageOutput(pg, producer, STAGE, TOPIC_ROUTED)
        self._producer = producer

    async def on_view(self, event: ev.ViewBuilt) -> None:
        turn = event.turn
        if await self._out.done(turn.turn_id):
            return
        if deadline.passed(turn, SPEC.name):
            # No decision recorded and none to learn from (dispatch fails the turn): the first arm stands in.
            expired = ev.Routed(
                turn=turn,
                text=event.text,
                state=event.state,
                view=event.view,
                chosen_arm=self._pool_cfg.arms[0],
            )
            await self._out.emit(expired, turn)
            return
        await self._out.emit(await self._route(event), turn)

    async def _route(self, event: ev.ViewBuilt) -> ev.Routed:
        """The turn's decision by the tenant's live policy version (or its canary version, for a session in
        the canary's share), and its shadow version's beside it (recorded and on the event, never answered
        by)."""
        turn = event.turn
        session_key = f"{turn.tenant}/{turn.user_id}/{turn.session_id}"
        draw = draw_key(turn.user_id, turn.seq)
        split = await self._store.split(turn.tenant, turn.session_id)
        live, shadow = split.deciding, split.shadow
        with step("router phases"):  # and the policy, in the same round trip
            phases, policy = await self._store.read_for_turn(
                turn.tenant, turn.user_id, session_key, turn.turn_id, live
            )
        state, load, depth = event.state, event.view.load, event.state.thread_depth
        x = self._store.features(state, load, depth, event.query_embedding, phases, live.feature_space)
        with step("router decide"):
            route = await self._store.decide(turn.tenant, turn.user_id, x, session_key, draw, policy, live)
            shadow_route = None
            if shadow is not None:
                xs = x
                if shadow.feature_space != live.feature_space:
                    xs = self._store.features(
                        state, load, depth, event.query_embedding, phases, shadow.feature_space
                    )
                shadow_route = await self._store.shadow_decide(turn.tenant, turn.user_id, xs, shadow, draw)
        arm = route.arm
        with step("router record"):
            await self._store.record_decision(
                turn.turn_id,
                route.policy_id,
                arm,
                x,
                session_key,
                turn.tenant,
                route,
                shadow_route,
                split.canary_version,
            )
        default = route.config_version == DEFAULT_VERSION
        return ev.Routed(
            turn=turn,
            text=event.text,
            state=event.state,
            view=event.view,
            features=[float(v) for v in x],
            scores=route.scores,
            chosen_arm=arm,
            propensity=route.propensity,
            policy_id=route.policy_id,
            policy_version=route.version,
            previous_arm=route.previous_arm or "",
            switch_penalty=route.switch_penalty,
            # A version's fallbacks stay among its arms, whose rewards its matrices can take.
            fallback_order=self._fallbacks(arm)
            if default
            else [a for a in self._pool_cfg.fallbacks_after(arm) if a in live.arms],
            cascade_min_logprob=self._cascade_threshold if default else 0.0,
            policy_frozen=not self._store.updates,
            config_version=route.config_version,
            rollout_role=split.role,
            canary_version=split.canary_version or "",
            **shadow_fields(shadow_route),
        )

    @property
    def _cascade_threshold(self) -> float:
        return self._settings.cascade_min_logprob if self._settings.routing_policy == "cascade" else 0.0

    def _fallbacks(self, arm: str) -> list[str]:
        if self._settings.routing_policy == "cascade":
            return [a for a in self._pool_cfg.cheapest_first() if a != arm]
        return self._pool_cfg.fallbacks_after(arm)

    async def on_judged(self, event: ev.Judged) -> None:
        if event.correction:
            await self._store.apply_correction(
                event.correction_id, event.turn.turn_id, event.arm, event.reward_delta
            )
            return
        _, run = await self._store.apply_judged(event)
        if run is None:
            return
        metrics.record_rollout_turn(run.tenant, run.role, run.arm, run.reward, run.cost_usd)
        metrics.record_rollout_test(run.tenant, run.evidence.statistic, run.evidence.boundary)
        if run.decided_at is not None:
            # This replica routes by the decision at once; the others within their roles' TTL.
            self._store.versions.invalidate(run.tenant)
            log.info(
                "tenant %s: canary %s %s (%s) after %d judged turns",
                run.tenant,
                run.candidate_version,
                run.evidence.decision.value,
                run.evidence.reason.value,
                run.turns,
            )
            try:
                await self.publish_decision(run.event())
            except Exception:  # committed: the row stands, unpublished; the next start publishes it
                log.exception("canary run %d: decision not published", run.rollout_id)

    async def publish_decision(self, event: ev.PolicyDecision) -> None:
        """The decision on mars.control, then marked published. Committed before: a publication that fails
        leaves the decision in router_rollouts (published_at NULL), sent again at the router's next start."""
        await self._producer.send_raw(TOPIC_CONTROL, event.SerializeToString(), event.tenant.encode())
        await self._store.rewards.rollouts.mark_published(event.rollout_id)

    async def publish_undelivered(self) -> None:
        """At start: the decisions a stopped router committed and never published (once; a failure is
        logged and left for the next start)."""
        try:
            for event in await self._store.rewards.rollouts.unpublished():
                log.info("publishing the undelivered decision of canary run %d", event.rollout_id)
                await self.publish_decision(event)
        except Exception:
            log.exception("undelivered canary decisions not published (tried again at the next start)")


def shadow_fields(shadow: ShadowResult | None) -> dict[str, Any]:
    """The shadow's fields of a Routed event or a RouteDecision (none without a shadow decision)."""
    if shadow is None:
        return {}
    return {
        "shadow_version": shadow.version,
        "shadow_arm": shadow.arm,
        "shadow_propensity": shadow.propensity,
        "shadow_score": shadow.score,
    }


class RouterServicer(svc_grpc.RouterServicer):
    def __init__(self, store: PolicyStore, settings: RouterSettings) -> None:
        self._store = store
        self._settings = settings

    @rpc_errors
    async def Route(self, request: svc.RouteRequest, context: grpc.aio.ServicerContext) -> svc.RouteDecision:
        check_ids(tenant=request.tenant, user_id=request.user_id)
        live, shadow = await self._store.policies(request.tenant)
        state, load, depth = request.state, request.view.load, request.turn_depth or 1
        x = self._store.features(state, load, depth, request.query_embedding, (), live.feature_space)
        route = await self._store.decide(request.tenant, request.user_id, x, live=live)
        shadow_route = None
        if shadow is not None:
            xs = self._store.features(state, load, depth, request.query_embedding, (), shadow.feature_space)
            shadow_route = await self._store.shadow_decide(request.tenant, request.user_id, xs, shadow)
        return svc.RouteDecision(
            features=[float(v) for v in x],
            scores=route.scores,
            chosen_arm=route.arm,
            policy_id=route.policy_id,
            policy_version=route.version,
            config_version=route.config_version,
            propensity=route.propensity,
            **shadow_fields(shadow_route),
        )

    async def _live_policy(
        self, request: svc.PolicyRequest
    ) -> tuple[str, VersionPolicy, VersionPolicy | None]:
        """The id of the matrices the request's tenant (and user) is routed by: its live version's."""
        scope = self._settings.policy_scope
        if (scope != "global" and not request.tenant) or (scope == "user" and not request.user_id):
            raise InvalidRequest("tenant (and user_id for user policies) required")
        for name in ("tenant", "user_id"):
            if getattr(request, name):  # given where the scope does not use it: still a usable id
                check_ids(**{name: getattr(request, name)})
        live, shadow = await self._store.policies(request.tenant)
        return self._store.policy_id(request.tenant, request.user_id, live), live, shadow

    @rpc_errors
    async def ResetPolicy(
        self, request: svc.PolicyRequest, context: grpc.aio.ServicerContext
    ) -> svc.PolicyInfo:
        policy_id, live, _ = await self._live_policy(request)
        await live.tables.reset(policy_id)
        return await self.GetPolicy(request, context)

    @rpc_errors
    async def GetPolicy(
        self, request: svc.PolicyRequest, context: grpc.aio.ServicerContext
    ) -> svc.PolicyInfo:
        policy_id, live, shadow = await self._live_policy(request)
        try:
            models, version = await self._store.load(policy_id, live)
        except PolicyCorrupt as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return svc.PolicyInfo(
            policy_id=policy_id,
            version=version,
            dimension=live.dim,
            frozen=not self._store.updates,
            arms=[svc.ArmSummary(arm=a, pulls=m.pulls, reward_sum=m.reward_sum) for a, m in models.items()],
            config_version=live.version,
            shadow_version=shadow.version if shadow else "",
        )


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, RouterSettings)
    pool_cfg = load_pool(settings.model_pool)
    policy_settings = settings
    if settings.routing_policy == "cascade":
        # The cascade always starts from the cheapest arm; dispatch escalates by confidence.
        policy_settings = settings.model_copy(
            update={"routing_policy": f"fixed:{pool_cfg.cheapest_first()[0]}"}
        )
    store = PolicyStore(ctx.pool, policy_settings, pool_cfg.arms)
    stage = RouterStage(store, pool_cfg, ctx.producer, ctx.pool, settings)
    routes = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        ROUTES,
        [Subscription(TOPIC_VIEW, ev.ViewBuilt, stage.on_view)],
    )
    updates = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        UPDATES,
        [Subscription(TOPIC_JUDGED, ev.Judged, stage.on_judged)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_RouterServicer_to_server, RouterServicer(store, settings), SPEC.grpc_service
            )
        ],
        consumers=[routes, updates],
        background=[stage.publish_undelivered],
    )


def main() -> None:
    run(SPEC, build)
