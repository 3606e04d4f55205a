"""The write-behind queue of stored pairs' embeddings (mars_memory.write_behind): batching, the bound,
failures and forgetting, with an in-process embedding function (the store's use is in
tests/integration/test_memory_store.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from mars.domain.memory_policy import MemoryRecord
from mars_memory.write_behind import WriteBehind


def record(n: int) -> MemoryRecord:
    return MemoryRecord(f"r{n}", "s", f"t{n}", n, f"question {n}", f"answer {n}")


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.stored: list[tuple[str, np.ndarray]] = []
        self.fail = fail

    def embed(self, records: Sequence[MemoryRecord]) -> list[np.ndarray]:
        self.calls.append([r.record_id for r in records])
        if self.fail:
            raise RuntimeError("model down")
        return [np.full((1, 2), float(r.seq), dtype=np.float32) for r in records]

    async def store(self, vectors: list[tuple[str, np.ndarray]]) -> None:
        self.stored.extend(vectors)


async def settle(behind: WriteBehind) -> None:
    for _ in range(200):
        if behind.backlog == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never settled")


def test_pairs_committed_together_are_embedded_in_one_call_and_stored() -> None:
    async def scenario() -> None:
        rec = Recorder()
        behind = WriteBehind(rec.embed, rec.store, max_pending=10, max_batch=3)
        for n in range(1, 6):
            behind.submit(record(n), ("t", "u"))
        pending = behind.pending("r4")
        assert pending is not None and behind.backlog == 5
        assert float((await pending)[0, 0]) == 4.0
        await settle(behind)
        assert rec.calls == [["r1", "r2", "r3"], ["r4", "r5"]]
        assert [rid for rid, _ in rec.stored] == ["r1", "r2", "r3", "r4", "r5"]
        assert behind.pending("r4") is None  # stored: a view reads it from Postgres now

    asyncio.run(scenario())


def test_the_bound_says_full_at_max_pending() -> None:
    async def scenario() -> None:
        rec = Recorder()
        behind = WriteBehind(rec.embed, rec.store, max_pending=2)
        behind.submit(record(1), ("t", "u"))
        assert not behind.full
        behind.submit(record(2), ("t", "u"))
        assert behind.full
        await settle(behind)
        assert not behind.full

    asyncio.run(scenario())


def test_a_failed_embedding_leaves_the_records_to_the_view_and_the_worker_goes_on() -> None:
    async def scenario() -> None:
        rec = Recorder(fail=True)
        behind = WriteBehind(rec.embed, rec.store, max_pending=10)
        behind.submit(record(1), ("t", "u"))
        pending = behind.pending("r1")
        assert pending is not None
        with pytest.raises(RuntimeError):
            await pending
        await settle(behind)
        assert rec.stored == []
        rec.fail = False
        behind.submit(record(2), ("t", "u"))
        await settle(behind)
        assert [rid for rid, _ in rec.stored] == ["r2"]

    asyncio.run(scenario())


def test_forgetting_a_user_drops_their_queued_pairs_only() -> None:
    async def scenario() -> None:
        rec = Recorder()
        behind = WriteBehind(rec.embed, rec.store, max_pending=10)
        behind.submit(record(1), ("t", "gone"))
        behind.submit(record(2), ("t", "kept"))
        gone = behind.pending("r1")
        behind.forget(("t", "gone"))  # before the worker ran
        assert gone is not None and gone.cancelled() and behind.pending("r1") is None
        await settle(behind)
        assert [rid for rid, _ in rec.stored] == ["r2"]
        assert all("r1" not in call for call in rec.calls)

    asyncio.run(scenario())


def test_bounds_must_be_positive() -> None:
    rec = Recorder()
    with pytest.raises(ValueError):
        WriteBehind(rec.embed, rec.store, max_pending=0)
