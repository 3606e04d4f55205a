"""User feedback on an answered turn (SubmitFeedback): checked against the caller's key and the turn's
record, then published on mars.feedback for the judge to turn into a reward correction."""

from __future__ import annotations

import time

import grpc
from mars import auth
from mars.auth import AuthError, Principal
from mars.bus.producer import EventProducer
from mars.config import SCHEMA_VERSION, TOPIC_FEEDBACK
from mars.domain.feedback import rating_from
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc

from mars_ingress.admission import InvalidTurn, TurnFailed, auth_failure, check_feedback
from mars_ingress.settings import IngressSettings
from mars_ingress.turns import TurnStore


class FeedbackFlow:
    def __init__(self, settings: IngressSettings, producer: EventProducer, turns: TurnStore) -> None:
        self._settings = settings
        self._producer = producer
        self._turns = turns

    def checked_rating(self, request: svc.FeedbackRequest, principal: Principal | None) -> float:
        """The request's [0, 1] rating, after filling its tenant (and a user-scoped key's user) from the key
        and checking its fields; TurnFailed or InvalidTurn before anything is read or written."""
        if principal is not None:
            try:
                request.tenant, request.user_id = auth.authorize(principal, request.tenant, request.user_id)
            except AuthError as exc:
                raise auth_failure(exc) from None
        check_feedback(request, self._settings.max_text_chars)
        try:
            return rating_from(request.rating, request.thumbs)
        except ValueError as exc:
            raise InvalidTurn(str(exc)) from None

    async def publish(self, request: svc.FeedbackRequest, rating: float) -> None:
        """Publish the feedback on the caller's own turn; TurnFailed when it is not theirs or has no answer
        to rate."""
        row = await self._turns.owner_of(request.turn_id)
        if row is None or (row[2], row[3]) != (request.tenant, request.user_id):
            # Someone else's turn reads as no turn at all: a different answer would tell a caller which
            # (content-hash) turn ids exist in other tenants.
            raise TurnFailed(grpc.StatusCode.NOT_FOUND, f"no turn {request.turn_id} of this tenant and user")
        if row[4] == "IMPORTED":
            raise TurnFailed(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"turn {request.turn_id} is imported history: no model answered it, so there is nothing to rate",
            )
        envelope = ev.TurnEnvelope(
            turn_id=request.turn_id,
            tenant=request.tenant,
            user_id=request.user_id,
            session_id=row[0],
            seq=row[1],
            received_at_ms=int(time.time() * 1000),
            schema_version=SCHEMA_VERSION,
            data_key_id=await self._producer.data_key_for(request.tenant, request.user_id),
        )
        await self._producer.publish(
            TOPIC_FEEDBACK,
            ev.Feedback(turn=envelope, rating=rating, comment=request.comment),
            envelope,
        )
