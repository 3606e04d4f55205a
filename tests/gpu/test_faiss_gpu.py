"""The FAISS GPU path of the memory index: same results as the CPU path, on a CUDA machine.

Skips (and says why) where faiss has no GPU support or no GPU is visible, as on CI and the laptop
default; run it on a GPU node with a faiss GPU build installed (see tests/gpu/device_check.sh). The CPU
default and the per-thread resources are also checked without a GPU in tests/unit/test_dense_device.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from mars.retrieval.dense import DenseIndex, ShardedDenseIndex, gpu_count

pytestmark = pytest.mark.skipif(
    gpu_count() == 0, reason="needs a CUDA GPU and a faiss GPU build (faiss.get_num_gpus() == 0 here)"
)


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim), dtype=np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def assert_same_hits(gpu: list[tuple[int, float]], cpu: list[tuple[int, float]], atol: float = 1e-4) -> None:
    """The same scores within float32 rounding, and the same ids wherever a score has no neighbour that
    close: two hits nearly tied may come out in either order on the two devices."""
    assert np.allclose([s for _, s in gpu], [s for _, s in cpu], atol=atol)
    for k, ((g_id, _), (c_id, c_score)) in enumerate(zip(gpu, cpu, strict=True)):
        tied = any(abs(c_score - cpu[j][1]) <= atol for j in (k - 1, k + 1) if 0 <= j < len(cpu))
        assert tied or g_id == c_id, (k, gpu, cpu)


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
            assert_same_hits(gpu.search(q, 10), cpu.search(q, 10))


def test_default_stays_on_cpu_even_with_a_gpu() -> None:
    assert not DenseIndex(64).on_gpu
    assert not ShardedDenseIndex(64).owner("a").on_gpu


def test_explicit_gpu_keeps_owners_apart() -> None:
    rng = np.random.default_rng(1)
    sharded = ShardedDenseIndex(64, use_gpu=True)
    a, b = _unit(rng, 50, 64), _unit(rng, 50, 64)
    sharded.owner("a").add(np.arange(50, dtype=np.int64), a)
    sharded.owner("b").add(np.arange(100, 150, dtype=np.int64), b)
    assert sharded.owner("a").on_gpu
    hits = sharded.search("a", b[0], 50)
    assert hits and all(i < 50 for i, _ in hits)
    # A write is searchable at once (the memory service's read-your-writes relies on it).
    sharded.owner("b").add(np.array([999], dtype=np.int64), a[3][None, :])
    assert sharded.search("b", a[3], 1)[0][0] == 999


def test_threads_build_and_search_gpu_indexes_concurrently() -> None:
    """Indexes built on four threads (each on its own resources) and searched from other threads at once
    give the CPU index's answers."""
    rng = np.random.default_rng(2)
    dim, owners, builders = 128, 16, 4
    data = [_unit(rng, 400, dim) for _ in range(owners)]
    queries = _unit(rng, 64, dim)
    gpu: dict[int, DenseIndex] = {}

    def build(first: int) -> None:
        for o in range(first, owners, builders):
            index = DenseIndex(dim, use_gpu=True)
            index.add(np.arange(400, dtype=np.int64) + o * 1000, data[o])
            gpu[o] = index

    threads = [threading.Thread(target=build, args=(t,)) for t in range(builders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(index._lane) for index in gpu.values()}) == builders
    jobs = [(o, q) for o in range(owners) for q in range(len(queries))]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: gpu[job[0]].search(queries[job[1]], 8), jobs))
    cpu = {o: DenseIndex(dim) for o in range(owners)}
    for o, index in cpu.items():
        index.add(np.arange(400, dtype=np.int64) + o * 1000, data[o])
    for (o, q), hits in zip(jobs, got, strict=True):
        assert_same_hits(hits, cpu[o].search(queries[q], 8))
