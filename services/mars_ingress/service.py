"""Ingress: the public gRPC API, as transport. Each call authenticates (mars_ingress.admission) and hands
its request to the flow that serves it: a turn to mars_ingress.turn_flow, feedback to mars_ingress.feedback,
forgetting a user to mars_ingress.forget_user, history import to mars_ingress.history_import. Errors map to
statuses in one place (mars.runtime.rpc_status)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from mars.bus.consumer import StageConsumer, forgets_only
from mars.bus.delivery import Subscription
from mars.bus.producer import EventProducer
from mars.config import (
    TOPIC_CONTROL,
    TOPIC_DEAD_LETTER,
    TOPIC_GENERATED,
    TOPIC_JUDGED,
    TOPIC_MEMORY_COMMITTED,
    TOPIC_TOKENS,
)
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, abort_rpc, run
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

from mars_ingress.admission import Admission, admin_target
from mars_ingress.feedback import FeedbackFlow
from mars_ingress.forget_user import UserForgetting
from mars_ingress.history_import import HistoryImport
from mars_ingress.replies import PendingReplies
from mars_ingress.settings import IngressSettings
from mars_ingress.spec import OUTCOMES, SPEC
from mars_ingress.state_context import StateContextClient
from mars_ingress.turn_flow import TurnFlow
from mars_ingress.turns import TurnStore

log = logging.getLogger(__name__)


class IngressServicer(svc_grpc.IngressServicer):
    def __init__(self, settings: IngressSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._producer = producer
        self._admission = Admission(settings, pool)
        self.turns = TurnStore(settings, producer, pool)
        self.state = StateContextClient(settings)
        self.replies = PendingReplies(settings)
        self._imports = HistoryImport(settings, producer, pool, self._admission, self.state)
        self._turn_flow = TurnFlow(
            settings, producer, self._admission, self.turns, self._imports, self.replies
        )
        self._feedback = FeedbackFlow(settings, producer, self.turns)
        self._forgetting = UserForgetting(settings, producer, pool)

    async def on_forgotten(self, event: ev.UserForgotten) -> None:
        """Every replica: the forgotten user's keys (deleted) stop working here now, not after the cache TTL."""
        self._admission.forget_user(event.tenant, event.user_id)
        self._producer.forget_user(event.tenant, event.user_id)

    async def SendTurn(self, request: svc.TurnRequest, context: grpc.aio.ServicerContext) -> svc.TurnReply:
        try:
            metadata = context.invocation_metadata()
            principal = await self._admission.authenticated(metadata)
            return await self._turn_flow.turn(
                request, metadata, principal, caller_remaining_s=context.time_remaining()
            )
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.SendTurn")
        raise AssertionError("unreachable")

    async def Converse(
        self, request_iterator: AsyncIterator[svc.TurnRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.TurnReply]:
        metadata = context.invocation_metadata()
        try:
            await self._admission.authenticated(metadata)  # a bad key ends the stream before its first turn
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.Converse")
        async for request in request_iterator:
            try:
                # Each turn checks the key again (cached for MARS_INGRESS_AUTH_CACHE_TTL_S): a key revoked while
                # the stream is open stops opening turns within that time, as on unary calls.
                principal = await self._admission.authenticated(metadata)
                if request.options.get("stream") == "true":
                    async for reply in self._turn_flow.streamed_turn(request, metadata, principal):
                        yield reply
                else:
                    yield await self._turn_flow.turn(request, metadata, principal)
            except Exception as exc:
                await abort_rpc(context, exc, "Ingress.Converse")

    async def SubmitFeedback(
        self, request: svc.FeedbackRequest, context: grpc.aio.ServicerContext
    ) -> svc.FeedbackReply:
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
            rating = self._feedback.checked_rating(request, principal)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.SubmitFeedback")
        # TurnFailed's status, or Postgres or the broker's: a plain one, never their text.
        try:
            await self._feedback.publish(request, rating)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.SubmitFeedback")
        return svc.FeedbackReply(accepted=True)

    async def ForgetUser(
        self, request: svc.ForgetUserRequest, context: grpc.aio.ServicerContext
    ) -> svc.ForgetUserReply:
        """Delete every row of the user (mars.forget) and tell every replica to drop what it caches of
        them. An admin key of the user's tenant only; idempotent (a second call deletes 0 rows)."""
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
            request.tenant = admin_target(principal, request.tenant, request.user_id, "forgetting a user")
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ForgetUser")
        try:
            key_id = principal.key_id if principal is not None else "-"
            return await self._forgetting.forget(request.tenant, request.user_id, key_id)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ForgetUser")

    async def WhoAmI(self, request: svc.WhoAmIRequest, context: grpc.aio.ServicerContext) -> svc.WhoAmIReply:
        """The call's key, verified: whom it acts for (empty with MARS_INGRESS_AUTH_REQUIRED=false)."""
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.WhoAmI")
        if principal is None:
            return svc.WhoAmIReply()
        return svc.WhoAmIReply(
            tenant=principal.tenant,
            user_id=principal.user_id or "",
            admin=principal.admin,
            key_id=principal.key_id,
        )

    async def ImportHistory(
        self, request: svc.ImportHistoryRequest, context: grpc.aio.ServicerContext
    ) -> svc.ImportHistoryReply:
        """Record a user's recorded turn pairs (mars_ingress.history) and publish each as an imported generated
        event: the memory writer stores it through its normal, idempotent commit. Admin key only."""
        try:
            principal = await self._admission.authenticate(context.invocation_metadata())
            request.tenant = admin_target(principal, request.tenant, request.user_id, "importing history")
            pairs = self._imports.checked_pairs(request)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ImportHistory")
        try:  # the wait reads Postgres too: its failures get the same plain status
            return await self._imports.import_requested(request, pairs, context.time_remaining)
        except Exception as exc:
            await abort_rpc(context, exc, "Ingress.ImportHistory")


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, IngressSettings)
    servicer = IngressServicer(settings, ctx.producer, ctx.pool)
    # Every replica reads every reply (a call waits on the replica it came to) ...
    replies = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        f"{SPEC.name}-replies",
        [
            Subscription(TOPIC_GENERATED, ev.Generated, servicer.replies.on_generated),
            Subscription(TOPIC_TOKENS, ev.TokenChunk, servicer.replies.on_token),
            Subscription(
                TOPIC_DEAD_LETTER, ev.DeadLetter, servicer.replies.on_dead_letter, requires_envelope=False
            ),
            Subscription(
                TOPIC_CONTROL, ev.UserForgotten, forgets_only(servicer.on_forgotten), requires_envelope=False
            ),
        ],
    )
    # ... and one replica of the group records each outcome, so a turn whose replica died still ends
    # ANSWERED or FAILED in ingress_turns.
    outcomes = StageConsumer(
        settings,
        ctx.producer,
        SPEC,
        OUTCOMES,
        [
            Subscription(TOPIC_GENERATED, ev.Generated, servicer.turns.record_generated),
            Subscription(
                TOPIC_DEAD_LETTER, ev.DeadLetter, servicer.turns.record_dead_letter, requires_envelope=False
            ),
            Subscription(TOPIC_MEMORY_COMMITTED, ev.MemoryCommitted, servicer.turns.record_stored),
            Subscription(TOPIC_JUDGED, ev.Judged, servicer.turns.record_judged),
        ],
    )
    return ServiceParts(
        bindings=[GrpcBinding(svc_grpc.add_IngressServicer_to_server, servicer, SPEC.grpc_service)],
        consumers=[replies, outcomes],
        background=[servicer.turns.sweep_orphans],
        on_stop=[servicer.state.aclose],
    )


def main() -> None:
    run(SPEC, build)
