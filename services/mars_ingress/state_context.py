"""The ingress as a caller of the state service: after a history import records its pairs, the context they
leave active goes to the state service, which owns state_context (StateEstimator.ImportContext, allowed
to the `ingress` identity alone; mars.topology)."""

from __future__ import annotations

import logging

import grpc
from mars import tls
from mars.identity import CallerIdentity, IdentityAioClientInterceptor
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc

from mars_ingress import history
from mars_ingress.admission import TurnFailed
from mars_ingress.settings import IngressSettings

log = logging.getLogger(__name__)

#: How long the state service gets to keep a context (one upsert).
IMPORT_CONTEXT_TIMEOUT_S = 10.0


class StateContextClient:
    """Hands an imported history's active context to the state service; without MARS_INGRESS_STATE_ADDR (a stack
    with no state service) it hands nothing, and says so once at start."""

    def __init__(self, settings: IngressSettings) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._stub: svc_grpc.StateEstimatorStub | None = None
        if not settings.state_addr:
            log.warning(
                "MARS_INGRESS_STATE_ADDR is not set: imported histories leave the controller's context as it is"
            )
            return
        identity = CallerIdentity.from_settings(settings)
        interceptors = [IdentityAioClientInterceptor(identity)] if identity is not None else None
        self._channel = tls.aio_channel(
            settings.state_addr, tls.ClientTls.from_settings(settings), interceptors=interceptors
        )
        self._stub = svc_grpc.StateEstimatorStub(self._channel)

    async def hand_over(
        self, tenant: str, user_id: str, pairs: list[history.ImportedPair], last_seq: int
    ) -> None:
        """The thread the pairs leave active becomes the user's context as of `last_seq` (unless a later turn
        moved it on: the state service keeps the newest). A call made again changes nothing."""
        if self._stub is None or not pairs:
            return
        recent, depth = history.last_thread_context(pairs)
        request = svc.ImportContextRequest(
            tenant=tenant,
            user_id=user_id,
            recent_texts=recent,
            thread_depth=depth,
            last_seq=last_seq,
            session_id=pairs[-1].session_id,
        )
        try:
            await self._stub.ImportContext(request, timeout=IMPORT_CONTEXT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("state ImportContext failed: %s %s", exc.code().name, exc.details())
            raise TurnFailed(
                grpc.StatusCode.UNAVAILABLE,
                "the pairs are recorded but the state service did not take their context "
                f"({exc.code().name}); make the same call again: nothing is imported twice",
            ) from None

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
