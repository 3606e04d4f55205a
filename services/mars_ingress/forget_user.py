"""The ingress's side of forgetting a user (mars.forget holds what every owner shares): the UserForgotten
event it publishes on mars.control, and the wait for every owner's acknowledgement (UserForgetting, for
ForgetUser). The operators' `mars forget` publishes the same event."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mars import forget
from mars.config import TOPIC_CONTROL
from mars.forget import FORGET_ACKS, FORGET_TABLES
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc

from mars_ingress.settings import IngressSettings
from mars_ingress.spec import NAME

if TYPE_CHECKING:  # the CLI (mars_tools.forget_cli) imports this module and loads the broker client late
    from mars.bus.producer import EventProducer
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)


def control_event(
    tenant: str, user_id: str, forget_id: str | None = None, turn_ids: Iterable[str] = ()
) -> ev.UserForgotten:
    return ev.UserForgotten(
        forget_id=forget_id or uuid.uuid4().hex,
        tenant=tenant,
        user_id=user_id,
        forgotten_at_ms=int(time.time() * 1000),
        turn_ids=sorted(set(turn_ids)),
    )


def event_key(tenant: str, user_id: str) -> bytes:
    """Keyed like the user's turn events (mars.bus.codec.event_key)."""
    return f"{tenant}/{user_id}".encode()


def merge_counts(*parts: dict[str, int]) -> dict[str, int]:
    """Rows deleted by table over every owner's part, every forgotten table listed (0 where none)."""
    total = {t.table: 0 for t in FORGET_TABLES}
    for part in parts:
        for table, n in part.items():
            total[table] = total.get(table, 0) + n
    return total


async def acknowledged(conn: Any, forget_id: str) -> dict[str, dict[str, int]]:
    """The acknowledgements of a forget so far: service -> rows deleted by table."""
    cur = await conn.execute(
        f"SELECT service, rows_deleted FROM {FORGET_ACKS} WHERE forget_id = %s", (forget_id,)
    )
    return {str(service): {str(k): int(v) for k, v in rows.items()} for service, rows in await cur.fetchall()}


class UserForgetting:
    """ForgetUser's work once the call is allowed: the ingress's own rows deleted, every replica and owner
    told on mars.control, and their acknowledgements awaited for up to MARS_INGRESS_FORGET_WAIT_S."""

    def __init__(self, settings: IngressSettings, producer: EventProducer, pool: AsyncConnectionPool) -> None:
        self._settings = settings
        self._producer = producer
        self._pool = pool

    async def forget(self, tenant: str, user_id: str, key_id: str) -> svc.ForgetUserReply:
        """Forget the user; the reply counts the rows deleted by table and names the owners that did not
        acknowledge in time (their rows go when they read the event). `key_id` is the caller's, for the log."""
        async with self._pool.connection() as conn:
            own, turns = await forget.forget_own_async(conn, NAME, tenant, user_id)
        event = control_event(tenant, user_id, turn_ids=turns)
        self._producer.forget_user(tenant, user_id)
        await self._producer.send_raw(TOPIC_CONTROL, event.SerializeToString(), event_key(tenant, user_id))
        acks = await self._acknowledgements(event.forget_id)
        counts = merge_counts(own, *acks.values())
        missing = [s for s in forget.acknowledgers() if s not in acks]
        if missing:
            log.warning(
                "forget %s: no acknowledgement from %s within %gs; their rows go when they read the event",
                event.forget_id,
                ", ".join(missing),
                self._settings.forget_wait_s,
            )
        log.warning(
            "forget %s: user %s of tenant %s forgotten by key %s: %s",
            event.forget_id,
            user_id,
            tenant,
            key_id,
            ", ".join(f"{t}={n}" for t, n in counts.items() if n),
        )
        return svc.ForgetUserReply(forget_id=event.forget_id, rows_deleted=counts, not_acknowledged=missing)

    async def _acknowledgements(self, forget_id: str) -> dict[str, dict[str, int]]:
        """Every other owner's acknowledgement of the forget, or those that came within MARS_INGRESS_FORGET_WAIT_S."""
        deadline = time.monotonic() + self._settings.forget_wait_s
        wanted = set(forget.acknowledgers())
        while True:
            async with self._pool.connection() as conn:
                acks = await acknowledged(conn, forget_id)
            if wanted <= set(acks) or time.monotonic() >= deadline:
                return acks
            await asyncio.sleep(0.1)
