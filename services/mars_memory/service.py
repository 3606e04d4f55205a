"""Memory service: durable turn pairs and threads in Postgres, and the state-conditioned candidate view
(Eq. 12, Table 6). Writes come off the answer path from the generated-event log; a view for turn n
waits (bounded) until turn n-1 of the same user is applied (read-your-writes). Transport only: the
store is mars_memory.store."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from mars import deadline
from mars.bus.consumer import StageConsumer
from mars.bus.delivery import Subscription
from mars.bus.output import StageOutput
from mars.bus.producer import EventProducer
from mars.config import (
    MEMORY_COMMIT_STAGE,
    MEMORY_VIEW_STAGE,
    TOPIC_GENERATED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_STATE,
    TOPIC_VIEW,
)
from mars.retrieval.dense import set_cpu_threads
from mars.retrieval.embedder import Embedder, load_embedder
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, check_ids, rpc_errors, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_memory.settings import MemorySettings
from mars_memory.spec import SPEC, VIEWS, WRITER
from mars_memory.store import MemoryStore

log = logging.getLogger(__name__)

VIEW_STAGE = MEMORY_VIEW_STAGE
#: A rebalance of the view group waits this long (not the consumers' 5 s) for views in flight. A view's work
#: takes milliseconds; one still in flight is nearly always waiting for the user's turn n-1 (read-your-writes),
#: which may itself be held by a rebalance, so each wait ran the full 5 s, stopping every view of the group:
#: in the k8s e2e rolling updates the group's rebalances took 4 to 7 s each and views fell up to 39 s behind.
#: A cancelled view is redone by the partition's next owner (views are idempotent by turn_id).
VIEW_REVOKE_WAIT_S = 1.0
COMMIT_STAGE = MEMORY_COMMIT_STAGE


class MemoryStage:
    def __init__(self, store: MemoryStore, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._store = store
        self._producer = producer
        self._views = StageOutput(pool, producer, VIEW_STAGE, TOPIC_VIEW)
        self._commits = StageOutput(pool, producer, COMMIT_STAGE, TOPIC_MEMORY_COMMITTED)

    async def on_state(self, event: ev.StateEstimated) -> None:
        turn = event.turn
        started = time.perf_counter()
        if await self._views.done(turn.turn_id):
            return
        if deadline.passed(turn, SPEC.name):
            # No retrieval and no read-your-writes wait: an empty view (mars.deadline).
            expired = ev.ViewBuilt(
                turn=turn,
                text=event.text,
                state=event.state,
                latency_ms=(time.perf_counter() - started) * 1000,
            )
            await self._views.emit(expired, turn)
            return
        self._store.accept_query_embedding(event.text, event.text_embedder, event.text_embedding)
        view, fresh = await self._store.view_after(
            turn.tenant,
            turn.user_id,
            event.text,
            event.state,
            after_seq=turn.seq - 1,
            session_id=turn.session_id,
        )
        view.possibly_stale = not fresh
        out = ev.ViewBuilt(
            turn=turn,
            text=event.text,
            state=event.state,
            view=view,
            latency_ms=(time.perf_counter() - started) * 1000,
            query_embedding=self._store.query_embedding(event.text),
        )
        await self._views.emit(out, turn)

    async def on_forgotten(self, event: ev.UserForgotten) -> None:
        self._producer.forget_user(event.tenant, event.user_id)
        held = await self._store.forget(event.tenant, event.user_id)
        log.info(
            "forget %s: dropped the index of %s/%s (%d records)",
            event.forget_id,
            event.tenant,
            event.user_id,
            held,
        )

    async def on_generated(self, event: ev.Generated) -> None:
        turn = event.turn
        committed = await self._store.commit(event)
        if not await self._commits.done(turn.turn_id):
            await self._commits.emit(committed, turn)


class MemoryServicer(svc_grpc.MemoryServicer):
    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    @rpc_errors
    async def BuildView(
        self, request: svc.BuildViewRequest, context: grpc.aio.ServicerContext
    ) -> ev.CandidateView:
        check_ids(tenant=request.tenant, user_id=request.user_id)
        return await self._store.view(
            request.tenant, request.user_id, request.text, request.state, request.session_id
        )

    @rpc_errors
    async def DescribeIndex(
        self, request: svc.DescribeIndexRequest, context: grpc.aio.ServicerContext
    ) -> svc.IndexDescription:
        check_ids(tenant=request.tenant, user_id=request.user_id)
        return await self._store.describe(request.tenant, request.user_id)


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, MemorySettings)
    set_cpu_threads(settings.faiss_threads)
    embedder: Embedder | None
    try:
        embedder = await asyncio.to_thread(
            load_embedder,
            settings.embedding_model,
            settings.embedding_backend,
            settings.embedding_cache_dir,
            precision=settings.embedding_precision,
        )
    except Exception:
        # Keep serving: BM25 over the Postgres records still builds views. Health says dense is down.
        log.exception("embedding model failed to load; serving lexical-only views")
        embedder = None
    store = MemoryStore(ctx.pool, settings, embedder)
    stage = MemoryStage(store, ctx.producer, ctx.pool)
    # Two consumers: a view waiting for turn n-1 must never block the commit of turn n-1 behind it.
    views = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        VIEWS,
        # The query's vector comes with the state event when the controller embedded the turn.
        [Subscription(TOPIC_STATE, ev.StateEstimated, stage.on_state)],
        revoke_wait_s=VIEW_REVOKE_WAIT_S,
    )
    writer = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        WRITER,
        [Subscription(TOPIC_GENERATED, ev.Generated, stage.on_generated)],
    )
    consumers = [c for role, c in (("views", views), ("writer", writer)) if role in settings.roles]
    return ServiceParts(
        # Every replica, whatever its roles, holds indexes (DescribeIndex, BuildView): each drops a forgotten
        # user's index on the control event (mars.runtime reads it on every replica).
        on_forgotten=stage.on_forgotten,
        bindings=[
            GrpcBinding(svc_grpc.add_MemoryServicer_to_server, MemoryServicer(store), SPEC.grpc_service)
        ],
        consumers=consumers,
        health={f"{SPEC.grpc_service}.dense": store.dense_available},
    )


def main() -> None:
    run(SPEC, build)
