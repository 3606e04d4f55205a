"""Where the dense index runs: CPU unless asked, and GPU resources per thread (no GPU needed here).

faiss-cpu has no GPU, so the GPU calls are replaced by recorders: `faiss.StandardGpuResources` (one
resource object per call) and `faiss.index_cpu_to_gpu` (records which resources an index was moved
with and keeps it a CPU index, so adds and searches still run for real). tests/gpu runs the real thing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import faiss
import numpy as np
import pytest
from mars.retrieval import dense
from mars.retrieval.dense import DenseIndex, ShardedDenseIndex
from mars.retrieval.hybrid import HybridMemory
from mars_tools.bench.memory_load import main as memory_load_main


class GpuRecorder:
    def __init__(self) -> None:
        self.resources: list[object] = []
        self.moves: list[object] = []

    def new_resources(self) -> object:
        res = object()
        self.resources.append(res)
        return res

    def to_gpu(self, resources: object, device: int, index: Any) -> Any:
        self.moves.append(resources)
        return index


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> GpuRecorder:
    """A process that reports one GPU; each thread starts with no GPU resources of its own yet."""
    recorder = GpuRecorder()
    monkeypatch.setattr(dense, "gpu_count", lambda: 1)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1, raising=False)
    monkeypatch.setattr(faiss, "StandardGpuResources", recorder.new_resources, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", recorder.to_gpu, raising=False)
    monkeypatch.setattr(dense, "_lanes", threading.local(), raising=False)
    monkeypatch.setattr(DenseIndex, "_gpu_resources", None, raising=False)
    return recorder


class DimOnly:
    dim = 8

    def encode(self, texts: Any) -> np.ndarray:
        return np.ones((len(texts), 8), dtype=np.float32)


def test_default_is_cpu_even_when_a_gpu_is_reported(fake_gpu: GpuRecorder) -> None:
    indexes = [DenseIndex(8), ShardedDenseIndex(8).owner("u")]
    memory = HybridMemory(DimOnly())  # type: ignore[arg-type]
    assert not any(i.on_gpu for i in indexes)
    assert fake_gpu.moves == [] and fake_gpu.resources == []
    memory.add_group("g", 0, ["hello world"], np.ones((1, 8), dtype=np.float32))
    assert memory.rank_groups("hello")


def test_gpu_only_when_asked(fake_gpu: GpuRecorder) -> None:
    index = DenseIndex(8, use_gpu=True)
    assert index.on_gpu and len(fake_gpu.moves) == 1
    assert ShardedDenseIndex(8, use_gpu=True).owner("u").on_gpu


def test_each_thread_gets_its_own_gpu_resources(fake_gpu: GpuRecorder) -> None:
    def build() -> None:
        DenseIndex(8, use_gpu=True)
        DenseIndex(8, use_gpu=True)

    build()
    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Three threads, two indexes each: one resource object per thread, reused within it.
    assert len(fake_gpu.moves) == 6 and len(set(map(id, fake_gpu.moves))) == 3
    assert len(fake_gpu.resources) == 3
    assert fake_gpu.moves[0] is fake_gpu.moves[1]


class OverlapProbe:
    """Stands in for the GPU index wrapper: records how many threads are inside it at once."""

    def __init__(self, base: Any) -> None:
        self.ntotal = 1
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.002)
        with self._lock:
            self.active -= 1
        return np.zeros((1, k), dtype=np.float32), np.zeros((1, k), dtype=np.int64)


def test_gpu_work_on_one_resource_object_is_serialised(
    fake_gpu: GpuRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index built on one thread and searched from several stays on its builder's resources, which
    FAISS does not allow to be used concurrently: those searches take turns."""
    monkeypatch.setattr(faiss, "IndexIDMap", OverlapProbe)
    index = DenseIndex(8, use_gpu=True)
    probe = index._index

    def searches() -> None:
        for _ in range(20):
            index.search(np.ones(8, dtype=np.float32), 1)

    threads = [threading.Thread(target=searches) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(probe, OverlapProbe) and probe.max_active == 1


def test_memory_load_bench_defaults_to_cpu(fake_gpu: GpuRecorder, capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--vectors", "200", "--users", "10", "--searches", "20", "--writes", "5", "--no-ingest"]
    assert memory_load_main(small) == 0
    assert "GPU: False" in capsys.readouterr().out and fake_gpu.moves == []


def test_memory_load_bench_refuses_gpu_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mars_tools.bench.memory_load.gpu_count", lambda: 0)
    assert memory_load_main(["--device", "gpu", "--vectors", "10", "--users", "1", "--no-ingest"]) == 2
