"""FAISS dense indexes, one per memory owner (a user, or a persona in the benchmark).

Why exact per-owner flat indexes: every search is scoped to one user, whose memory is hundreds to a few
thousand vectors, so an exact inner-product scan over that user's vectors costs microseconds even when
the process holds a million vectors in all; approximate global indexes (IVF, HNSW) would need a user filter
and would trade recall for nothing.

Why CPU by default: on an H200 node per-user 8-NN scans of ~100 vectors measured 2x slower on the GPU
than CPU FAISS (a kernel launch costs more than the scan), so the GPU is used only when asked for
(`use_gpu=True`, the memory service's `MARS_MEMORY_USE_GPU`), for large per-user memories or batched queries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np


def set_cpu_threads(threads: int) -> None:
    """OpenMP threads of one CPU search. A per-user scan is too small to split: with two threads on a busy
    2-core machine a 4-query search over 1,000 vectors took 13 ms against 6 ms with one (the threads wait
    for each other); parallelism comes from searching several users at once."""
    faiss.omp_set_num_threads(max(1, threads))


def gpu_count() -> int:
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


@dataclass(frozen=True)
class GpuLane:
    """One thread's FAISS GPU resources (streams, scratch memory, cuBLAS handle) and the lock that
    serialises the GPU indexes built on them: a StandardGpuResources is not safe for concurrent use, and
    an index stays bound to its creator's resources even when another thread later searches it."""

    resources: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


_lanes = threading.local()


def gpu_lane() -> GpuLane:
    """The calling thread's GpuLane, created on the thread's first GPU index."""
    lane: GpuLane | None = getattr(_lanes, "lane", None)
    if lane is None:
        lane = _lanes.lane = GpuLane(faiss.StandardGpuResources())
    return lane


class DenseIndex:
    """Exact inner-product search over one owner's vectors, ids are int64 chosen by the caller.

    CPU unless `use_gpu` is set (see the module note)."""

    def __init__(self, dim: int, use_gpu: bool = False) -> None:
        self.dim = dim
        self.on_gpu = use_gpu
        base: Any = faiss.IndexFlatIP(dim)
        self._lane: GpuLane | None = None
        if use_gpu:
            self._lane = gpu_lane()
            base = faiss.index_cpu_to_gpu(self._lane.resources, 0, base)
            self._index: Any = faiss.IndexIDMap(base)
        else:
            self._index = faiss.IndexIDMap2(base)

    def _gpu_guard(self) -> contextlib.AbstractContextManager[Any]:
        # CPU FAISS searches need no lock; GPU work takes the lock of the resources the index was built on.
        return self._lane.lock if self._lane is not None else contextlib.nullcontext()

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids) == 0:
            return
        vecs = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        with self._gpu_guard():
            self._index.add_with_ids(vecs, np.ascontiguousarray(ids, dtype=np.int64))

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top-k (id, inner product) for one query vector."""
        if k <= 0 or len(self) == 0:
            return []
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        with self._gpu_guard():
            scores, ids = self._index.search(q, min(k, len(self)))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def search_many(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        with self._gpu_guard():
            scores, ids = self._index.search(q, max(1, min(k, len(self))))
        return scores, ids


class ShardedDenseIndex:
    """Many owners' indexes in one process (a memory-service replica holds the users of its partitions)."""

    def __init__(self, dim: int, use_gpu: bool = False) -> None:
        self.dim = dim
        self._use_gpu = use_gpu
        self._owners: dict[Hashable, DenseIndex] = {}

    def owner(self, key: Hashable) -> DenseIndex:
        index = self._owners.get(key)
        if index is None:
            index = self._owners[key] = DenseIndex(self.dim, self._use_gpu)
        return index

    def drop(self, key: Hashable) -> None:
        self._owners.pop(key, None)

    def search(self, key: Hashable, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        index = self._owners.get(key)
        return index.search(query, k) if index is not None else []

    @property
    def total(self) -> int:
        return sum(len(i) for i in self._owners.values())

    def __len__(self) -> int:
        return len(self._owners)
