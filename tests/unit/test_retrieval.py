"""Dense index (real FAISS), chunking and the hybrid memory with the real MiniLM embedder."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from mars.retrieval.dense import DenseIndex, ShardedDenseIndex
from mars.retrieval.embedder import LruEmbedder, SentenceTransformerEmbedder
from mars.retrieval.hybrid import HybridConfig, HybridMemory, split_words
from mars_tools.bench.policies import CachingEmbedder, make_retriever, session_chunks
from mars_tools.bench.realmem import Session, Turn


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


class Counting:
    def __init__(self, inner: SentenceTransformerEmbedder) -> None:
        self.inner = inner
        self.calls: list[int] = []

    @property
    def dim(self) -> int:
        return self.inner.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(len(texts))
        return self.inner.encode(texts)


def test_dense_index_is_exact_inner_product() -> None:
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(200, 16)).astype(np.float32)
    ids = np.arange(1000, 1200, dtype=np.int64)
    index = DenseIndex(16, use_gpu=False)
    index.add(ids, vecs)
    q = rng.normal(size=16).astype(np.float32)
    got = index.search(q, 5)
    expected = np.argsort(-(vecs @ q))[:5]
    assert [i for i, _ in got] == [int(ids[j]) for j in expected]
    assert got[0][1] == pytest.approx(float(vecs[expected[0]] @ q), rel=1e-5)
    assert index.search(q, 0) == [] and DenseIndex(16, use_gpu=False).search(q, 3) == []


def test_sharded_index_never_crosses_owners() -> None:
    sharded = ShardedDenseIndex(4, use_gpu=False)
    sharded.owner("alice").add(np.array([1, 2]), np.eye(4, dtype=np.float32)[:2])
    sharded.owner("bob").add(np.array([3]), np.eye(4, dtype=np.float32)[:1])
    assert {i for i, _ in sharded.search("alice", np.eye(4, dtype=np.float32)[0], 10)} == {1, 2}
    assert [i for i, _ in sharded.search("bob", np.eye(4, dtype=np.float32)[1], 10)] == [3]
    assert sharded.search("carol", np.ones(4, dtype=np.float32), 10) == []
    assert sharded.total == 3


def test_split_words_chunks_long_text_without_losing_words() -> None:
    text = " ".join(f"w{i}" for i in range(500))
    pieces = split_words(text, max_words=100, overlap=20)
    assert all(len(p.split()) <= 100 for p in pieces)
    covered = {w for p in pieces for w in p.split()}
    assert covered == set(text.split())
    assert pieces[1].split()[0] == "w80"  # 20 words of overlap
    assert split_words("short text") == ["short text"]
    assert split_words("   ") == []


def test_embedder_is_normalised_and_offline(embedder: SentenceTransformerEmbedder) -> None:
    vecs = embedder.encode(["a zebra on the savanna", "a zebra in the grassland", "quarterly tax filing"])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]


def test_hybrid_memory_ranks_relevant_group_first(embedder: SentenceTransformerEmbedder) -> None:
    memory = HybridMemory(embedder, HybridConfig(recency_weight=0.5, prf_weight=0.5), use_gpu=False)
    memory.add_group("safari", 0, ["User: plan a zebra safari in Kenya\nAssistant: Day 1 Masai Mara"])
    memory.add_group("poem", 1, ["User: write a poem about a quokka\nAssistant: Small smiling quokka"])
    memory.add_group("taxes", 2, ["User: help me file my taxes\nAssistant: Gather your W-2 forms"])
    ranked = [g for g, _ in memory.rank_groups("which park did we pick for the zebra trip?", k=3)]
    assert ranked[0] == "safari"
    assert set(ranked) == {"safari", "poem", "taxes"}
    assert memory.rank_groups("anything", k=0) == []
    with pytest.raises(ValueError):
        memory.add_group("poem", 3, ["dup"])


def test_hybrid_memory_rebuild_gives_identical_results(embedder: SentenceTransformerEmbedder) -> None:
    groups = [
        (f"g{i}", i, [f"User: topic {i} about {w}\nAssistant: notes on {w}"])
        for i, w in enumerate(["gardening", "tomatoes", "car repair", "brakes", "baking bread", "sourdough"])
    ]

    def build() -> HybridMemory:
        m = HybridMemory(embedder, HybridConfig(recency_weight=1.0, prf_weight=1.0), use_gpu=False)
        for key, pos, chunks in groups:
            m.add_group(key, pos, chunks)
        return m

    a, b = build(), build()
    for q in ("how do I fix squeaky brakes", "growing tomatoes", "starter for bread"):
        assert a.rank_groups(q, k=6) == b.rank_groups(q, k=6)


def test_a_group_grown_chunk_by_chunk_ranks_as_the_whole_group(embedder: SentenceTransformerEmbedder) -> None:
    """extend_group (the memory service's per-session index, fed one turn pair at a time) gives the ranking
    of add_group with the whole session (how `mars bench realmem` indexes it)."""
    sessions = {
        "bees": [
            "User: I keep bees\nAssistant: Check the frames",
            "User: harvest honey when?\nAssistant: Capped",
        ],
        "fern": ["User: repot a fern\nAssistant: Peat-free compost"],
        "chess": [
            "User: chess openings\nAssistant: Italian game",
            "User: and for black?\nAssistant: Sicilian",
        ],
    }
    config = HybridConfig(
        recency_weight=1.0, prf_weight=1.0, prf_top=2, centroid_weight=0.5, context_weight=0.3
    )
    whole = HybridMemory(embedder, config, use_gpu=False)
    grown = HybridMemory(embedder, config, use_gpu=False)
    position = 0
    for key, chunks in sessions.items():
        whole.add_group(key, position + len(chunks), chunks)
        for chunk in chunks:
            position += 1
            grown.extend_group(key, position, [chunk])
    for query in ("when do I harvest honey", "what should black play", "compost for ferns"):
        a = whole.rank_groups(query, ["I keep bees"], 10)
        b = grown.rank_groups(query, ["I keep bees"], 10)
        assert [k for k, _ in a] == [k for k, _ in b]
        # The whole group embeds its chunks in one padded batch, the grown one a chunk at a time: the
        # vectors (and centroids) differ in the last float32 bits, by how much depends on the CPU's BLAS
        # kernels. The fused scores are reciprocal-rank sums, so they match whenever every ranking does;
        # the tolerance stays far below one rank step of the smallest weight (0.5 * (1/62 - 1/63) ~ 1.3e-4).
        assert np.allclose([s for _, s in a], [s for _, s in b], rtol=1e-4, atol=1e-5)
    assert grown.dense_vectors == whole.dense_vectors and len(grown) == len(whole) == 3


def test_rounding_in_the_centroid_product_does_not_order_the_feedback_ranking(
    embedder: SentenceTransformerEmbedder,
) -> None:
    """Each top group's feedback similarity is its own (exactly 1): centroids off by a rounding step, as
    another CPU's BLAS kernel leaves them, give the same fused scores (they swapped two groups' ranks on an
    AMD EPYC before)."""
    config = HybridConfig(recency_weight=1.0, prf_weight=1.0, prf_top=2)
    memory = HybridMemory(embedder, config, use_gpu=False)
    for i, text in enumerate(
        [
            "User: I keep bees\nAssistant: Check the frames",
            "User: bees swarm\nAssistant: ok",
            "User: chess openings\nAssistant: Italian game",
        ]
    ):
        memory.add_group(f"g{i}", i + 1, [text])
    before = memory.rank_groups("bees", k=3)
    centroids = memory.index.centroids()  # the array the next search reads (no piece added meanwhile)
    assert centroids is not None
    for row in range(len(centroids)):  # one float32 step up or down, row by row
        centroids[row] *= np.float32(1 + 1.2e-7) if row % 2 else np.float32(1 - 1.2e-7)
    after = memory.rank_groups("bees", k=3)
    assert [k for k, _ in after] == [k for k, _ in before]
    assert np.allclose([s for _, s in after], [s for _, s in before], rtol=0, atol=1e-9)


def test_an_excluded_group_is_ranked_as_absent(embedder: SentenceTransformerEmbedder) -> None:
    memory = HybridMemory(
        embedder, HybridConfig(recency_weight=1.0, prf_weight=1.0, prf_top=1), use_gpu=False
    )
    memory.add_group("own", 3, ["User: harvest honey from my beehive\nAssistant: when capped"])
    memory.add_group("bees", 1, ["User: I keep bees in the garden\nAssistant: nice"])
    memory.add_group("chess", 2, ["User: chess openings\nAssistant: Italian game"])
    assert memory.rank_groups("harvest honey beehive", k=3)[0][0] == "own"
    ranked = memory.rank_groups("harvest honey beehive", k=3, exclude={"own", "unknown"})
    assert [k for k, _ in ranked] == ["bees", "chess"]


def test_empty_memory_returns_empty_view(embedder: SentenceTransformerEmbedder) -> None:
    assert HybridMemory(embedder, use_gpu=False).rank_groups("hello") == []


def test_lru_embedder_embeds_each_text_once(embedder: SentenceTransformerEmbedder) -> None:
    counting = Counting(embedder)
    lru = LruEmbedder(counting, size=2)
    first = lru.encode(["a", "b"])
    again = lru.encode(["b", "a"])
    assert counting.calls == [2]
    assert np.allclose(first[0], again[1])
    lru.encode(["c"])  # evicts the least recently used ("b")
    lru.encode(["b"])
    assert counting.calls == [2, 1, 1]


def test_caching_embedder_persists(tmp_path: Path, embedder: SentenceTransformerEmbedder) -> None:
    counting = Counting(embedder)
    cache = CachingEmbedder(counting, tmp_path)
    v = cache.encode(["persist me"])
    cache.save()
    reloaded = CachingEmbedder(counting, tmp_path)
    assert np.allclose(reloaded.encode(["persist me"]), v)
    assert counting.calls == [1]


def test_session_chunks_are_turn_pairs() -> None:
    s = Session(
        "u", 0, "", (Turn("User", "q1"), Turn("Assistant", "a1"), Turn("User", "q2"), Turn("Assistant", "a2"))
    )
    assert session_chunks(s) == ["User: q1\nAssistant: a1", "User: q2\nAssistant: a2"]


def test_unknown_policy_is_rejected(embedder: SentenceTransformerEmbedder) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_retriever("oracle", embedder)
    with pytest.raises(ValueError, match="needs an embedder"):
        make_retriever("mars", None)


def test_lexical_only_memory_when_no_embedder() -> None:
    memory = HybridMemory(None, HybridConfig(recency_weight=0.5, prf_weight=1.0), use_gpu=False)
    memory.add_group("safari", 0, ["User: plan a zebra safari in Kenya"])
    memory.add_group("poem", 1, ["User: write a poem about a quokka"])
    assert not memory.dense
    assert memory.rank_groups("zebra safari dates", k=2)[0][0] == "safari"


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the model's fp32 ONNX export, made once for the module's ONNX tests (seconds of torch)."""
    from mars.retrieval.embedder import OnnxEmbedder

    folder = tmp_path_factory.mktemp("onnx")
    OnnxEmbedder(cache_dir=str(folder))
    return folder


def test_onnx_embedder_matches_torch(onnx_dir: Path, embedder: SentenceTransformerEmbedder) -> None:
    from mars.retrieval.embedder import OnnxEmbedder, load_embedder

    assert any(onnx_dir.glob("*.onnx"))  # exported locally, nothing fetched
    onnx = OnnxEmbedder(cache_dir=str(onnx_dir))
    texts = ["a zebra on the savanna", "quarterly tax filing for a small bakery " * 5, "x"]
    a, b = embedder.encode(texts), onnx.encode(texts)
    assert b.shape == a.shape
    assert np.all(np.sum(a * b, axis=1) > 0.9999)
    assert onnx.encode([]).shape == (0, 384)
    with pytest.raises(ValueError, match="unknown embedding backend"):
        load_embedder(backend="tpu")


def test_onnx_embedder_loads_an_export_without_torch(
    onnx_dir: Path, embedder: SentenceTransformerEmbedder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the export already there (the service image bakes it in), the ONNX embedder takes its tokenizer and
    dimensions from the model folder: sentence-transformers (and so torch) is never loaded, same vectors."""
    from mars.retrieval import embedder as module

    module.OnnxEmbedder(cache_dir=str(onnx_dir), precision="int8")  # quantizes the fp32 export

    def no_torch(*args: object, **kw: object) -> None:
        raise AssertionError("the full model was loaded although its ONNX export exists")

    monkeypatch.setattr(module, "SentenceTransformerEmbedder", no_torch)
    texts = ["a zebra on the savanna", "quarterly tax filing for a small bakery " * 80, ""]
    light = module.OnnxEmbedder(cache_dir=str(onnx_dir))
    assert light.dim == 384
    assert np.all(np.sum(embedder.encode(texts) * light.encode(texts), axis=1) > 0.9999)
    assert module.OnnxEmbedder(cache_dir=str(onnx_dir), precision="int8").encode(texts).shape == (3, 384)


def test_a_missing_embedding_model_fails_at_once_without_importing_torch(tmp_path: Path) -> None:
    """A model path that does not exist is refused before torch and sentence-transformers load (seconds of
    CPU at a service start that then serves lexical-only views)."""
    script = (
        "import sys\n"
        "from mars.retrieval.embedder import load_embedder\n"
        "try:\n"
        f"    load_embedder({str(tmp_path / 'missing-model')!r}, cache_dir={str(tmp_path)!r})\n"
        "except FileNotFoundError as exc:\n"
        "    print('refused:', exc)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"refused: no embedding model at {tmp_path / 'missing-model'}" in run.stdout
    assert "torch imported: False" in run.stdout
