"""The ingress's side of forgetting a user (mars.forget holds what every owner shares): the UserForgotten
event it publishes on mars.control, and the wait for every owner's acknowledgement. The operators'
`mars forget` publishes the same event."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

from mars.forget import FORGET_ACKS, FORGET_TABLES
from mars.v1 import events_pb2 as ev


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
