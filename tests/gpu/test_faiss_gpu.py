"""The FAISS GPU path of the memory index: same results as the CPU path, on a CUDA machine.

Skips (and says why) where faiss has no GPU support or no GPU is visible, as on CI and the laptop
default; run it on a GPU node with a faiss GPU build installed (see tests/gpu/device_check.sh).
"""

from __future__ import annotations

import numpy as np
import pytest
from mars.retrieval.dense import DenseIndex, ShardedDenseIndex, gpu_count

pytestmark = pytest.mark.skipif(
    gpu_count() == 0, reason="needs a CUDA GPU and a faiss GPU build (faiss.get_num_gpus() == 0 here)"
)


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_gpu_index_matches_cpu_index() -> None:
    rng = np.random.default_rng(0)
    dim = 384
    for owner in range(20):
        vecs = _unit(rng, 300 + owner * 13, dim)
        ids = np.arange(owner * 10_000, owner * 10_000 + len(vecs), dtype=np.int64)
        gpu, cpu = DenseIndex(dim, use_gpu=True), DenseIndex(dim, use_gpu=False)
        assert gpu.on_gpu and not cpu.on_gpu
        gpu.add(ids, vecs)
        cpu.add(ids, vecs)
        for q in _unit(rng, 5, dim):
            g, c = gpu.search(q, 10), cpu.search(q, 10)
            assert [i for i, _ in g] == [i for i, _ in c]
            assert np.allclose([s for _, s in g], [s for _, s in c], atol=1e-4)


def test_default_detects_gpu_and_keeps_owners_apart() -> None:
    rng = np.random.default_rng(1)
    sharded = ShardedDenseIndex(64)
    a, b = _unit(rng, 50, 64), _unit(rng, 50, 64)
    sharded.owner("a").add(np.arange(50, dtype=np.int64), a)
    sharded.owner("b").add(np.arange(100, 150, dtype=np.int64), b)
    assert sharded.owner("a").on_gpu
    hits = sharded.search("a", b[0], 50)
    assert hits and all(i < 50 for i, _ in hits)
    # A write is searchable at once (the memory service's read-your-writes relies on it).
    sharded.owner("b").add(np.array([999], dtype=np.int64), a[3][None, :])
    assert sharded.search("b", a[3], 1)[0][0] == 999
