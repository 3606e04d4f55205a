"""FAISS dense indexes, one per memory owner (a user, or a persona in the benchmark).

Why exact per-owner flat indexes: every search is scoped to one user, whose memory is hundreds to a few
thousand vectors, so an exact inner-product scan over that user's vectors costs microseconds even when
the process holds a million vectors in all; approximate global indexes (IVF, HNSW) would need a user filter
and would trade recall for nothing. On a CUDA machine the same code path moves each index to the GPU.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import faiss
import numpy as np


def gpu_count() -> int:
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get is not None else 0


class DenseIndex:
    """Exact inner-product search over one owner's vectors, ids are int64 chosen by the caller."""

    _gpu_resources: Any = None

    def __init__(self, dim: int, use_gpu: bool | None = None) -> None:
        self.dim = dim
        self.on_gpu = gpu_count() > 0 if use_gpu is None else use_gpu
        base: Any = faiss.IndexFlatIP(dim)
        if self.on_gpu:
            if DenseIndex._gpu_resources is None:
                DenseIndex._gpu_resources = faiss.StandardGpuResources()
            base = faiss.index_cpu_to_gpu(DenseIndex._gpu_resources, 0, base)
        self._index = faiss.IndexIDMap2(base) if not self.on_gpu else faiss.IndexIDMap(base)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if len(ids) == 0:
            return
        vecs = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, self.dim)
        self._index.add_with_ids(vecs, np.ascontiguousarray(ids, dtype=np.int64))

    def search(self, query: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Top-k (id, inner product) for one query vector."""
        if k <= 0 or len(self) == 0:
            return []
        q = np.ascontiguousarray(query, dtype=np.float32).reshape(1, self.dim)
        scores, ids = self._index.search(q, min(k, len(self)))
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if i >= 0]

    def search_many(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32).reshape(-1, self.dim)
        return self._index.search(q, max(1, min(k, len(self))))


class ShardedDenseIndex:
    """Many owners' indexes in one process (a memory-service replica holds the users of its partitions)."""

    def __init__(self, dim: int, use_gpu: bool | None = None) -> None:
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
