"""Stored pairs embedded behind the commit, so the write path never delays the view path.

A turn pair is committed (record, thread, applied seq) without its vectors; the embedding runs behind it,
in batches, and is written to the record after. The user's next view does not wait for the embedding to be
done at commit: it finds the record applied, and where its vectors are not stored yet, it takes them from
the embedding under way (`pending`), which is nearly always done by the time the user's next turn comes.
So read-your-writes stays exact: the view holds turn n-1 with the same vectors an inline embedding gives.

The lag is bounded: with `max_pending` records waiting, a commit embeds its own pair before it commits
(the writer slows down instead of the backlog growing). A record left without vectors (the process stopped
before its embedding was stored) is embedded by the first view that loads it, as a record of another model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
from mars.domain.memory_policy import MemoryRecord

log = logging.getLogger(__name__)

#: Embeds records' texts in one call: one array of chunk vectors per record, in order.
EmbedBatch = Callable[[Sequence[MemoryRecord]], list[np.ndarray]]
#: Writes (record_id, vectors) pairs to the records.
StoreVectors = Callable[[list[tuple[str, np.ndarray]]], Awaitable[None]]


class WriteBehind:
    """Embeds committed records behind the commit, up to `max_batch` per call (see the module's docstring)."""

    def __init__(
        self, embed_batch: EmbedBatch, store_vectors: StoreVectors, max_pending: int, max_batch: int = 8
    ) -> None:
        if max_pending < 1 or max_batch < 1:
            raise ValueError("max_pending and max_batch must be at least 1")
        self._embed_batch = embed_batch
        self._store_vectors = store_vectors
        self._max_pending = max_pending
        self._max_batch = max_batch
        #: record_id -> its vectors; a record stays here until its vectors are stored.
        self._pending: dict[str, asyncio.Future[np.ndarray]] = {}
        self._queue: list[MemoryRecord] = []
        self._owner: dict[str, tuple[str, str]] = {}
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    @property
    def full(self) -> bool:
        """The lag is at its bound: embed the next pair in its commit."""
        return len(self._pending) >= self._max_pending

    @property
    def backlog(self) -> int:
        return len(self._pending)

    def submit(self, record: MemoryRecord, owner: tuple[str, str]) -> None:
        """Embed `record` (committed without vectors) behind, and store its vectors; `owner` is its
        (tenant, user_id), for `forget`."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._run(), name="memory-write-behind")
        self._pending[record.record_id] = loop.create_future()
        self._queue.append(record)
        self._owner[record.record_id] = owner
        assert self._wake is not None
        self._wake.set()

    def pending(self, record_id: str) -> asyncio.Future[np.ndarray] | None:
        """The vectors under way for a record committed here without them; None when there are none."""
        return self._pending.get(record_id)

    def forget(self, owner: tuple[str, str]) -> None:
        """Drop the queued records of a forgotten user (their rows are gone: nothing to embed or store, and
        their text is not kept here)."""
        record_ids = {rid for rid, o in self._owner.items() if o == owner}
        self._queue = [r for r in self._queue if r.record_id not in record_ids]
        for rid in record_ids:
            self._owner.pop(rid, None)
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.cancel()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            try:
                vectors = await asyncio.to_thread(self._embed_batch, batch)
            except Exception as exc:
                # The records stay without vectors: the view that loads one embeds it (and stores it).
                log.exception("write-behind embedding of %d records failed", len(batch))
                self._settle(batch, exc)
                continue
            for record, vec in zip(batch, vectors, strict=True):
                future = self._pending.get(record.record_id)
                if future is not None and not future.done():
                    future.set_result(vec)
            try:
                await self._store_vectors([(r.record_id, v) for r, v in zip(batch, vectors, strict=True)])
            except Exception:
                # Not stored: a view that loads these records later embeds them again.
                log.exception("storing %d write-behind vectors failed", len(batch))
            self._settle(batch, None)

    def _settle(self, batch: list[MemoryRecord], exc: Exception | None) -> None:
        """The batch's records leave `pending` (their vectors are stored, or they failed)."""
        for record in batch:
            self._owner.pop(record.record_id, None)
            future = self._pending.pop(record.record_id, None)
            if future is not None and not future.done():
                future.set_exception(exc or RuntimeError("write-behind embedding failed"))
                future.exception()  # retrieved here: a view awaiting it handles it; nobody else must
