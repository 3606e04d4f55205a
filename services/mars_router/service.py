"""Router service: features x_t = phi(z, c~, q), LinUCB arm choice (Eq. 15), and the online update
(Eq. 11/16) applied exactly once per judged turn_id. Policy matrices live in Postgres (mars_router.store);
this module is the transport: the Kafka stages and the gRPC servicer.

With `MARS_POLICY_UPDATES=false` the policy is frozen (the paper's "No online update" ablation,
mars_full_no_update): the router still routes with its current matrices and still consumes and checks
judged events, but never changes A or b, so the policy version does not move either."""

from __future__ import annotations

import logging
from typing import Literal

import grpc
from mars import consumer_groups
from mars.bus import EventProducer, StageConsumer, StageOutput, Subscription
from mars.config import TOPIC_JUDGED, TOPIC_ROUTED, TOPIC_VIEW, ServiceSettings
from mars.domain.bandits import draw_key
from mars.pool import ModelPool, load_pool
from mars.runtime import GrpcBinding, InvalidRequest, ServiceContext, ServiceParts, check_ids, rpc_errors, run
from mars.telemetry import step
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_router.store import MIGRATIONS, PolicyCorrupt, PolicyStore, policy_id_for

log = logging.getLogger(__name__)

STAGE = "router"


class RouterSettings(ServiceSettings):
    model_pool: str = "config/models.local.yaml"
    alpha: float = 0.8
    ridge: float = 1.0
    #: The paper keeps one policy per user; tenant or global share learning across users.
    policy_scope: Literal["user", "tenant", "global"] = "user"
    #: A new user policy copies its tenant policy's matrices ("tenant:<tenant>") when one exists.
    warm_start_from_tenant: bool = False
    #: linucb (the paper's), thompson, eps-greedy, random, fixed:<arm>, query-linucb (LinUCB over the query
    #: embedding without session state: the no-QTM / MetaLLM-style baseline), or cascade (cheapest arm
    #: first, escalating by price while the answer's mean token log-probability is below cascade_min_logprob).
    routing_policy: str = "linucb"
    cascade_min_logprob: float = -1.0
    epsilon: float = 0.1
    thompson_v: float = 0.3
    #: Seed of the stochastic policies (thompson, eps-greedy, random). Set, each turn draws from its own
    #: generator seeded by (seed, user_id, seq), so a re-drive of the same log with the same configuration
    #: and seed makes the same decisions whatever the process, restart or interleaving of users. Unset
    #: (default): draws come from OS entropy. Keyed on (user_id, seq), not turn_id, because ingress mints
    #: a fresh turn_id for every re-driven turn while a user's seq repeats (also under --tenant-suffix).
    routing_seed: int | None = None
    #: Session affinity: UCB points an arm other than the session's previous one loses (0 = off).
    switch_penalty: float = 0.0
    #: Arm used when a policy's matrices fail the sanity check (default: the pool's first arm).
    default_arm: str | None = None
    #: Rewards outside this range are rejected (utility is in [0, 1]; cost only lowers it).
    min_reward: float = -1000.0
    max_reward: float = 1.0
    #: Attempts at an optimistic policy update before the reward is handed back for redelivery.
    update_attempts: int = 50
    #: Online updates (Eq. 11). False freezes every policy as it is (the paper's "No online update"
    #: diagnostic): routing uses the current matrices, judged rewards and corrections are checked and
    #: recorded in the ledger with applied = false, and A, b and the version stay unchanged. Recording
    #: them means turning updates back on starts learning from the next judged turn: a redelivered or
    #: replayed reward from the frozen period is a ledger duplicate, never applied late to a policy that
    #: did not choose by it, and the reward stays visible to whoever reads the ledger.
    policy_updates: bool = True


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

    async def on_view(self, event: ev.ViewBuilt) -> None:
        turn = event.turn
        if await self._out.done(turn.turn_id):
            return
        session_key = f"{turn.tenant}/{turn.user_id}/{turn.session_id}"
        with step("router phases"):
            phases = await self._store.recent_phases(session_key, turn.turn_id)
        x = self._store.features(
            event.state, event.view.load, event.state.thread_depth, event.query_embedding, phases
        )
        with step("router decide"):
            route = await self._store.decide(
                turn.tenant, turn.user_id, x, session_key, draw_key(turn.user_id, turn.seq)
            )
        arm = route.arm
        with step("router record"):
            await self._store.record_decision(turn.turn_id, route.policy_id, arm, x, session_key)
        out = ev.Routed(
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
            fallback_order=self._fallbacks(arm),
            cascade_min_logprob=self._cascade_threshold,
            policy_frozen=not self._store.updates,
        )
        await self._out.emit(out, turn)

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
        await self._store.apply_reward(event.turn.turn_id, event.arm, event.reward, list(event.failed_arms))


class RouterServicer(svc_grpc.RouterServicer):
    def __init__(self, store: PolicyStore, settings: RouterSettings) -> None:
        self._store = store
        self._settings = settings

    @rpc_errors
    async def Route(self, request: svc.RouteRequest, context: grpc.aio.ServicerContext) -> svc.RouteDecision:
        check_ids(tenant=request.tenant, user_id=request.user_id)
        x = self._store.features(
            request.state, request.view.load, request.turn_depth or 1, request.query_embedding
        )
        route = await self._store.decide(request.tenant, request.user_id, x)
        return svc.RouteDecision(
            features=[float(v) for v in x],
            scores=route.scores,
            chosen_arm=route.arm,
            policy_id=route.policy_id,
            policy_version=route.version,
        )

    def _policy_id(self, request: svc.PolicyRequest) -> str:
        scope = self._settings.policy_scope
        if (scope != "global" and not request.tenant) or (scope == "user" and not request.user_id):
            raise InvalidRequest("tenant (and user_id for user policies) required")
        for name in ("tenant", "user_id"):
            if getattr(request, name):  # given where the scope does not use it: still a usable id
                check_ids(**{name: getattr(request, name)})
        return policy_id_for(
            self._settings.policy_scope, request.tenant, request.user_id, self._store.feature_space
        )

    @rpc_errors
    async def ResetPolicy(
        self, request: svc.PolicyRequest, context: grpc.aio.ServicerContext
    ) -> svc.PolicyInfo:
        await self._store.reset(self._policy_id(request))
        return await self.GetPolicy(request, context)

    @rpc_errors
    async def GetPolicy(
        self, request: svc.PolicyRequest, context: grpc.aio.ServicerContext
    ) -> svc.PolicyInfo:
        policy_id = self._policy_id(request)
        try:
            models, version = await self._store.load(policy_id)
        except PolicyCorrupt as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return svc.PolicyInfo(
            policy_id=policy_id,
            version=version,
            dimension=self._store.dim,
            frozen=not self._store.updates,
            arms=[svc.ArmSummary(arm=a, pulls=m.pulls, reward_sum=m.reward_sum) for a, m in models.items()],
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
        "router",
        consumer_groups.ROUTER.name,
        [Subscription(TOPIC_VIEW, ev.ViewBuilt, stage.on_view)],
    )
    updates = StageConsumer(
        settings,
        ctx.producer,
        "router",
        consumer_groups.ROUTER_UPDATES.name,
        [Subscription(TOPIC_JUDGED, ev.Judged, stage.on_judged)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_RouterServicer_to_server, RouterServicer(store, settings), "mars.v1.Router"
            )
        ],
        consumers=[routes, updates],
    )


def main() -> None:
    run("router", RouterSettings(), build, MIGRATIONS)
