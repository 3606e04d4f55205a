"""The learned memory ranker: features, a deterministic fit that learns, the model file and its fallback,
and the hybrid memory re-ordering its fused candidates with it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from mars.retrieval.embedder import SentenceTransformerEmbedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridMemory
from mars.retrieval.ranker import (
    _NAME,
    DEFAULT_RANKER,
    FEATURE_NAMES,
    FEATURES_VERSION,
    SIMILAR,
    SUPPORT_TOP,
    GroupSignals,
    LearnedRanker,
    RankerError,
    RankingQuery,
    candidate_features,
    coverage,
    fit_ranker,
    load_ranker,
    query_terms,
)


def _queries(seed: int, n: int = 60, candidates: int = 12) -> list[RankingQuery]:
    """Gold is the candidate with the highest value of one feature column (term_coverage), whatever its
    fused position: a ranker must learn to read that column."""
    rng = np.random.default_rng(seed)
    column = FEATURE_NAMES.index("term_coverage")
    out = []
    for _ in range(n):
        x = rng.normal(size=(candidates, len(FEATURE_NAMES)))
        gold = np.zeros(candidates, dtype=bool)
        gold[int(np.argmax(x[:, column]))] = True
        out.append(RankingQuery(x, gold))
    return out


def _top1(ranker: LearnedRanker, queries: list[RankingQuery]) -> float:
    return float(np.mean([q.gold[ranker.order(q.features)[0]] for q in queries]))


@pytest.mark.parametrize("hidden", [0, 4])
def test_fit_learns_the_signal_and_is_deterministic(hidden: int) -> None:
    train, held_out = _queries(1, n=400), _queries(2)
    ranker = fit_ranker(train, hidden=hidden, l2=1e-4, steps=200)
    # The fused order (index 0 first) finds the gold 1 time in 12; the fitted model most of the time.
    assert _top1(ranker, held_out) >= 0.8
    again = fit_ranker(train, hidden=hidden, l2=1e-4, steps=200)
    np.testing.assert_allclose(again.scores(held_out[0].features), ranker.scores(held_out[0].features), atol=1e-9)


def test_fit_weighs_queries() -> None:
    """A query's weight counts as copies of it (the loss and the standardisation alike); weight 0 changes
    nothing; every weight 1 is the plain fit."""
    train, extra, held_out = _queries(5, n=120), _queries(6, n=40), _queries(7, n=20)
    plain = fit_ranker(train)
    x = np.concatenate([q.features for q in held_out])
    ones = fit_ranker([RankingQuery(q.features, q.gold, 1.0) for q in train])
    np.testing.assert_array_equal(ones.scores(x), plain.scores(x))
    ignored = fit_ranker([*train, *(RankingQuery(q.features, q.gold, 0.0) for q in extra)])
    np.testing.assert_allclose(ignored.scores(x), plain.scores(x), rtol=0, atol=1e-12)
    doubled = fit_ranker([*train, *(RankingQuery(q.features, q.gold, 2.0) for q in extra)])
    twice = fit_ranker([*train, *extra, *extra])
    np.testing.assert_allclose(doubled.scores(x), twice.scores(x), rtol=0, atol=1e-6)
    light = fit_ranker([*train, *(RankingQuery(q.features, q.gold, 0.1) for q in extra)])
    assert not np.allclose(light.scores(x), plain.scores(x), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="weights"):
        fit_ranker([*train, RankingQuery(extra[0].features, extra[0].gold, -1.0)])


def test_fit_refuses_data_without_gold() -> None:
    x = np.zeros((5, len(FEATURE_NAMES)))
    with pytest.raises(ValueError, match="no training query"):
        fit_ranker([RankingQuery(x, np.zeros(5, dtype=bool))])


def test_model_file_round_trip_and_fallback(tmp_path: Path) -> None:
    ranker = fit_ranker(_queries(3), hidden=2, steps=50, version="test-v")
    path = tmp_path / "ranker.json"
    ranker.save(path)
    loaded, why = load_ranker(path)
    assert loaded is not None and why == ""
    assert loaded.version == "test-v"
    x = _queries(4)[0].features
    np.testing.assert_allclose(loaded.scores(x), ranker.scores(x), rtol=1e-12)

    raw = json.loads(path.read_text())
    for broken, reason in [
        ({**raw, "features_version": "ranker-features-v0"}, "this build computes"),
        ({**raw, "linear": raw["linear"][:-1]}, "shapes"),
        ({**raw, "scale": [0.0] * len(FEATURE_NAMES)}, "positive"),
        ({**raw, "mean": ["x"] * len(FEATURE_NAMES)}, "unreadable"),
    ]:
        path.write_text(json.dumps(broken))
        assert load_ranker(path)[0] is None
        with pytest.raises(RankerError, match=reason):
            LearnedRanker.load(path)
    path.write_text("{not json")
    none, why = load_ranker(path)
    assert none is None and str(path) in why
    assert load_ranker(tmp_path / "missing.json")[0] is None


def test_the_packaged_model_loads() -> None:
    ranker, why = load_ranker(DEFAULT_RANKER)
    assert ranker is not None, why
    meta = json.loads(DEFAULT_RANKER.read_text())["meta"]
    assert meta["realmem_queries"] > 0
    assert json.loads(DEFAULT_RANKER.read_text())["features_version"] == FEATURES_VERSION


def test_query_terms_and_coverage() -> None:
    text = "Did Maria book the 3:30 flight to Lisbon for 2 people?"
    tokens = ["maria", "book", "3", "30", "flight", "lisbon", "2", "people"]
    terms = query_terms(text, tokens, {"maria": 3.0})
    assert terms.numbers == {"3", "30", "2"}  # as the lexical index splits them
    assert terms.names == {"maria", "lisbon"}  # "Did" opens the sentence: not a name
    docs = [{"maria": 2, "flight": 1, "2": 1}, {"people": 1}]

    def presence(words: list[str]) -> np.ndarray:
        return np.array([[w in d for d in docs] for w in words])

    covered = coverage(terms, presence, 2)  # type: ignore[arg-type]
    np.testing.assert_allclose(covered[0], [3 / 8, 1.0, 1 / 3, 1 / 2])  # only maria has idf here
    np.testing.assert_allclose(covered[1], [1 / 8, 0.0, 0.0, 0.0])
    assert coverage(terms, presence, 0).shape == (0, 4)  # type: ignore[arg-type]


_SESSIONS = {
    "safari": "User: plan a zebra safari in Kenya\nAssistant: Day 1 Masai Mara, day 2 Amboseli",
    "poem": "User: write a poem about a quokka\nAssistant: Small smiling quokka on Rottnest",
    "taxes": "User: help me file my 2024 taxes\nAssistant: Gather your W-2 forms first",
    "budget": "User: the Kenya trip budget is 3000 dollars\nAssistant: Lodges cost 250 a night",
    "recipe": "User: a vegan lasagna recipe please\nAssistant: Layer cashew ricotta and spinach",
}


def _memory(embedder: SentenceTransformerEmbedder, without: str = "") -> HybridMemory:
    memory = HybridMemory(embedder, POLICY_CONFIGS["mars"])
    for i, (key, text) in enumerate(_SESSIONS.items()):
        if key != without:
            memory.add_group(key, i, [text])
    return memory


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


@pytest.fixture(scope="module")
def memory(embedder: SentenceTransformerEmbedder) -> HybridMemory:
    return _memory(embedder)


def test_candidates_carry_the_fused_order_and_their_signals(memory: HybridMemory) -> None:
    query, context = "how much was the Kenya safari budget?", ["zebra trip plans"]
    fused = [key for key, _ in memory.rank_groups(query, context, k=5)]
    signals = memory.candidates(query, context, n=3)
    assert signals is not None
    assert signals.keys == fused[:3]
    x = candidate_features(signals)
    assert x.shape == (3, len(FEATURE_NAMES))
    assert np.isfinite(x).all()
    assert signals.has_context and signals.n_groups == 5
    # Only the groups naming Kenya cover the query's name.
    named = {k: c for k, c in zip(signals.keys, signals.coverage[:, 3], strict=True)}
    assert named.get("budget") == 1.0 and named.get("safari") == 1.0
    assert memory.candidates(query, context, n=3, exclude={"budget"}) is not None
    assert "budget" not in memory.candidates(query, context, exclude={"budget"}).keys  # type: ignore[union-attr]


def test_an_excluded_group_is_not_counted_among_the_ranked(
    memory: HybridMemory, embedder: SentenceTransformerEmbedder
) -> None:
    """The live service excludes the turn's own session; the benches' memory never held it. Every feature a
    ranker reads must be the same in both (before, the excluded group still counted among the groups and
    in BM25's idf and average length)."""
    query, context = "how much was the Kenya safari budget?", ["zebra trip plans"]
    excluded = memory.candidates(query, context, exclude={"budget"})
    held = _memory(embedder, without="budget").candidates(query, context)
    assert excluded is not None and held is not None
    assert excluded.n_groups == held.n_groups == 4
    assert sorted(excluded.keys) == sorted(held.keys)
    by_key = {k: i for i, k in enumerate(held.keys)}
    order = [by_key[k] for k in excluded.keys]
    np.testing.assert_array_equal(excluded.recency_rank, held.recency_rank[order])
    np.testing.assert_array_equal(excluded.dense_rank, held.dense_rank[order])
    np.testing.assert_array_equal(excluded.lexical_rank, held.lexical_rank[order])
    np.testing.assert_allclose(excluded.lexical_query, held.lexical_query[order], rtol=1e-12)
    # The centroid and PRF similarities are float32 products over matrices of other shapes: their rounding
    # differs (1e-7), nothing else may.
    np.testing.assert_allclose(candidate_features(excluded), candidate_features(held)[order], atol=1e-6)


def test_a_ranker_reorders_the_candidates_only(memory: HybridMemory) -> None:
    query = "how much was the Kenya safari budget?"
    fused = [key for key, _ in memory.rank_groups(query, k=5)]
    # A model that ranks by recency alone (newest first): most recent group is "recipe" (position 4).
    f = len(FEATURE_NAMES)
    linear = np.zeros(f)
    linear[FEATURE_NAMES.index("recency_rank_log")] = -1.0
    newest = LearnedRanker("t", np.zeros(f), np.ones(f), linear, np.zeros((0, f)), np.zeros(0), np.zeros(0))
    memory.ranker_seconds = 0.0
    reranked = memory.rank_groups(query, k=5, ranker=newest)
    assert memory.ranker_seconds > 0.0  # what the ranker added is measured
    assert [key for key, _ in reranked] == ["recipe", "budget", "taxes", "poem", "safari"]
    plain = memory.rank_groups(query, k=5)
    assert sorted(k for k, _ in reranked) == sorted(k for k, _ in plain)  # the same groups
    # The head's fused scores, in falling order along the new ranking (packing clips by score).
    assert [s for _, s in reranked] == [s for _, s in plain]
    assert fused != [key for key, _ in reranked]
    # k cuts after re-ordering.
    assert [key for key, _ in memory.rank_groups(query, k=2, ranker=newest)] == ["recipe", "budget"]


def test_names_are_found_as_the_plain_pattern_finds_them() -> None:
    """The name pattern looks back from after the capital (faster); it must match what the plain pattern
    (lookbehinds first) matches."""
    plain = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][\w'-]+")
    texts = [
        "Did Maria book the 3:30 flight to Lisbon? Then Paris. And O'Neil-Smith's X-ray",
        "Maria at the start. Bob after a stop!\tCarl after a tab?\nDora after a newline",
        "aB cD_e x.Yz 1Ab _Ab É Éclair Ωmega, Zo.Zo!Zo 'Quote' \"Dq\" (Paren) -Dash A B",
        "", " ", "A", "Ab", " Ab", ".  Ab", "x. Ab", "x.\u00a0Ab", "x?\u2003Ab",
    ]
    for text in texts:
        assert [m.group(0) for m in _NAME.finditer(text)] == [m.group(0) for m in plain.finditer(text)], text


def _reference_neighbourhood(s: GroupSignals) -> np.ndarray:
    """The neighbourhood features written plainly (both masks, no symmetry used)."""
    n = len(s.keys)
    if n < 2 or not s.centroids.size:
        return np.zeros((n, 4))
    sim = s.centroids @ s.centroids.T
    np.fill_diagonal(sim, -1.0)
    newer = s.recency_rank[None, :] < s.recency_rank[:, None]
    older = s.recency_rank[None, :] > s.recency_rank[:, None]
    top = min(SUPPORT_TOP, n)
    weights = np.maximum(s.fused[:top], 0.0)
    near = np.where(sim[:, :top] > -1.0, sim[:, :top], 0.0)
    mass = weights.sum() - np.where(np.arange(n) < top, np.pad(weights, (0, n - top)), 0.0)
    return np.stack(
        [
            np.where(newer, sim, -1.0).max(axis=1),
            np.where(older, sim, -1.0).max(axis=1),
            np.log1p(((sim > SIMILAR) & newer).sum(axis=1)),
            (near @ weights) / np.maximum(mass, 1e-9),
        ],
        axis=1,
    )


def _reference_features(s: GroupSignals) -> np.ndarray:
    """candidate_features written plainly, one stacked block at a time (the form the model was fitted on)."""
    n = len(s.keys)
    spread = float(s.dense_query.std())
    z = (s.dense_query - s.dense_query.mean()) / spread if spread > 1e-9 else np.zeros(n)
    fused_rank = np.arange(n, dtype=np.float64)
    shares = np.stack([np.maximum(s.lexical_query, 0.0), s.fused])
    tops = shares.max(axis=1, keepdims=True)
    shares = np.divide(shares, tops, out=np.zeros_like(shares), where=tops > 0)
    logs = np.log1p(np.stack([shares[0] * tops[0], fused_rank, s.dense_rank, s.lexical_rank, s.recency_rank]))
    return np.concatenate(
        [
            np.stack([s.dense_query, s.dense_query - s.dense_query.max(), z, s.dense_mean], axis=1),
            np.stack([logs[0], shares[0], shares[1], 1.0 / (1.0 + fused_rank)], axis=1),
            logs[1:].T,
            (s.recency_rank / max(s.n_groups, 1))[:, None],
            np.stack([s.centroid, s.centroid - s.centroid.max(), s.prf], axis=1),
            np.log1p(np.stack([s.chunks, s.doc_length], axis=1)),
            s.coverage,
            np.full((n, 1), 1.0 if s.has_context else 0.0),
            np.full((n, 1), math.log1p(s.n_groups)),
            _reference_neighbourhood(s),
        ],
        axis=1,
    )


def _random_signals(rng: np.random.Generator, n: int, dim: int, flat: bool = False) -> GroupSignals:
    n_groups = n + 7
    dense = np.full(n, 0.4) if flat else rng.uniform(-0.2, 0.9, n)
    centroids = rng.normal(size=(n_groups, dim)).astype(np.float32)
    centroids[1] = centroids[0] + 0.05  # near-duplicates
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-9)
    lexical = np.zeros(n) if flat else np.where(rng.random(n) < 0.3, 0.0, rng.uniform(0, 12, n))
    return GroupSignals(
        keys=[f"g{i}" for i in range(n)],
        n_groups=n_groups,
        has_context=bool(rng.random() < 0.5),
        dense_query=dense,
        dense_mean=rng.uniform(0, 0.5, n),
        lexical_query=lexical,
        fused=np.sort(rng.uniform(0, 0.1, n))[::-1].copy(),
        dense_rank=rng.permutation(n_groups)[:n].astype(np.float64),
        lexical_rank=rng.permutation(n_groups + 1)[:n].astype(np.float64),
        recency_rank=rng.permutation(n_groups)[:n].astype(np.float64),
        centroid=rng.uniform(-0.1, 0.8, n),
        prf=rng.uniform(0.2, 1.0, n),
        chunks=rng.integers(1, 30, n).astype(np.float64),
        doc_length=rng.integers(5, 3000, n).astype(np.float64),
        coverage=rng.random((n, 4)),
        centroids=centroids[rng.permutation(n_groups)[:n]] if dim else np.zeros((n, 0)),
    )


@pytest.mark.parametrize(
    ("n", "dim", "flat"), [(50, 64, False), (12, 16, True), (7, 8, False), (1, 8, False), (30, 0, False)]
)
def test_features_equal_their_plain_form(n: int, dim: int, flat: bool) -> None:
    """The features are written column by column for speed; the numbers must be the plain form's, or a model
    file fitted on those would rank differently."""
    rng = np.random.default_rng(n * 100 + dim)
    for _ in range(5):
        s = _random_signals(rng, n, dim, flat)
        np.testing.assert_array_equal(candidate_features(s), _reference_features(s))
    assert candidate_features(_random_signals(rng, 0, 8)).shape == (0, len(FEATURE_NAMES))


def test_signals_of_a_growing_memory_equal_those_of_one_built_at_once() -> None:
    """The lexical index caches postings arrays between searches: a memory searched while it grows (groups
    added, extended, excluded) must give exactly the signals of a memory built at once (lexical only: a
    grown group's centroid is a sum's, rounded otherwise than one built at once)."""
    sessions = [
        ("kenya", ["User: plan a Kenya safari with zebra days", "Assistant: Masai Mara then Amboseli"]),
        ("taxes", ["User: my 2024 taxes and the W-2 form", "Assistant: gather the forms"]),
        ("budget", ["User: the Kenya budget is 3000 dollars", "Assistant: lodges cost 250"]),
        ("poem", ["User: a quokka poem", "Assistant: small smiling quokka"]),
    ]
    queries = [("what was the Kenya safari budget in 2024?", ("zebra trip",)), ("quokka taxes", ())]
    grown = HybridMemory(None, POLICY_CONFIGS["mars"])
    for i, (key, chunks) in enumerate(sessions):
        grown.add_group(key, i, chunks[:1])
        for query, context in queries:
            grown.candidates(query, context)
        grown.extend_group(key, i, chunks[1:])
        for query, context in queries:
            grown.candidates(query, context, exclude={"taxes"})
    later = "User: and a zebra budget in 2024"
    grown.extend_group("kenya", 9, [later])
    whole = HybridMemory(None, POLICY_CONFIGS["mars"])
    for i, (key, chunks) in enumerate(sessions):
        whole.add_group(key, 9 if key == "kenya" else i, [*chunks, later] if key == "kenya" else chunks)
    for query, context in queries:
        for exclude in ((), ("taxes",)):
            a, b = grown.candidates(query, context, exclude=exclude), whole.candidates(query, context, exclude=exclude)
            assert a is not None and b is not None and a.keys == b.keys
            np.testing.assert_array_equal(a.coverage, b.coverage)
            np.testing.assert_array_equal(candidate_features(a), candidate_features(b))
