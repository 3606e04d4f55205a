"""The learned memory ranker: features, a deterministic fit that learns, the model file and its fallback,
and the hybrid memory re-ordering its fused candidates with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mars.retrieval.embedder import SentenceTransformerEmbedder
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridMemory
from mars.retrieval.ranker import (
    DEFAULT_RANKER,
    FEATURE_NAMES,
    FEATURES_VERSION,
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


@pytest.fixture(scope="module")
def memory() -> HybridMemory:
    memory = HybridMemory(SentenceTransformerEmbedder(), POLICY_CONFIGS["mars"])
    texts = {
        "safari": "User: plan a zebra safari in Kenya\nAssistant: Day 1 Masai Mara, day 2 Amboseli",
        "poem": "User: write a poem about a quokka\nAssistant: Small smiling quokka on Rottnest",
        "taxes": "User: help me file my 2024 taxes\nAssistant: Gather your W-2 forms first",
        "budget": "User: the Kenya trip budget is 3000 dollars\nAssistant: Lodges cost 250 a night",
        "recipe": "User: a vegan lasagna recipe please\nAssistant: Layer cashew ricotta and spinach",
    }
    for i, (key, text) in enumerate(texts.items()):
        memory.add_group(key, i, [text])
    return memory


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
