"""Read-your-writes: a view for turn n waits, bounded, until turn n-1 of the same user is applied.

Any replica may apply a user's writes, so the applied seq is Postgres's (memory_progress); this process's
own commits are also remembered here, so that a view waiting on one of them wakes at once, without a read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

#: Reads a user's applied seq from Postgres: (tenant, user_id) -> seq.
AppliedSeq = Callable[[str, str], Awaitable[int]]


class ReadYourWrites:
    """The bounded wait for a user's applied seq (`wait_s` at most)."""

    #: The wait reads the applied seq again after this long, doubling up to LAST.
    FIRST_POLL_S = 0.05
    LAST_POLL_S = 0.4
    #: Users whose committed seq is remembered before the memory starts again (it is a cache: a wait that
    #: finds nothing here reads Postgres).
    MAX_USERS = 100_000

    def __init__(self, applied_seq: AppliedSeq, wait_s: float) -> None:
        self._applied_seq = applied_seq
        self._wait_s = wait_s
        self._applied = asyncio.Condition()
        #: The highest seq this process committed per user (committed in Postgres before it is set here).
        self._committed_seq: dict[tuple[str, str], int] = {}

    async def committed(self, tenant: str, user_id: str, seq: int) -> None:
        """This process committed the user's turn `seq` (in Postgres already): wake the waits on it."""
        key = (tenant, user_id)
        if len(self._committed_seq) > self.MAX_USERS:
            self._committed_seq.clear()
        self._committed_seq[key] = max(self._committed_seq.get(key, 0), seq)
        async with self._applied:
            self._applied.notify_all()

    def forget(self, tenant: str, user_id: str) -> None:
        self._committed_seq.pop((tenant, user_id), None)  # a forgotten user's seqs start again

    async def wait(self, tenant: str, user_id: str, seq: int) -> bool:
        """True once seq is applied; False when the bounded wait ran out. This process's own commits wake
        the wait of their user only (no read); Postgres is read at first and after each poll interval, which
        grows, for commits by another replica. (Woken and reading at every commit of any user, a backlog of
        waiting views read the applied seq 13.7 times per turn at 25/s: CPU the backlog's commits needed.)"""
        key = (tenant, user_id)
        deadline = time.monotonic() + self._wait_s
        poll_s = self.FIRST_POLL_S
        while True:
            if self._committed_seq.get(key, 0) >= seq:
                return True
            if await self._applied_seq(tenant, user_id) >= seq:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            async with self._applied:
                try:
                    await asyncio.wait_for(
                        self._applied.wait_for(lambda: self._committed_seq.get(key, 0) >= seq),
                        timeout=min(poll_s, remaining),
                    )
                    return True
                except TimeoutError:
                    pass
            poll_s = min(poll_s * 2, self.LAST_POLL_S)
