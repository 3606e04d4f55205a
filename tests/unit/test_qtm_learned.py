"""The learned QTM controller (mars_state.qtm.learned, `mars train qtm`): features, deterministic training, the
model file (round trip, and refusal of a missing, corrupt or foreign one), the guarded state it answers,
and the state service falling back to the rules when the model cannot load."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from fresh_process import across_processes
from mars.v1 import events_pb2 as ev
from mars_state.qtm.guard import GuardedEstimator
from mars_state.qtm.labelled import DEFAULT_LABELS, load_labelled
from mars_state.qtm.learned import (
    CONTEXT_NGRAM_BUCKETS,
    DEFAULT_MODEL,
    FEATURES_VERSION,
    HEADS,
    TURN_NGRAM_BUCKETS,
    LearnedController,
    LearnedModel,
    ModelFileError,
    featurize,
    hashed_ngrams,
    standardised_columns,
)
from mars_state.service import make_estimator
from mars_state.settings import StateSettings
from mars_tools.train_cli import train

DIM = 16


def fake_embed(texts: Sequence[str]) -> np.ndarray:
    """A stand-in embedder for pure-logic tests: a fixed pseudo-random unit vector per text."""
    rows = []
    for t in texts:
        seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
        v = np.random.default_rng(seed).standard_normal(DIM)
        rows.append(v / np.linalg.norm(v))
    return np.stack(rows).astype(np.float32)


@pytest.fixture(scope="module")
def small_set():  # type: ignore[no-untyped-def]
    turns = load_labelled(DEFAULT_LABELS.read_text().splitlines())
    keep = {"p01", "p02", "p03", "p04"}
    return [t for t in turns if t.persona in keep]


def test_features_have_one_shape_with_and_without_context() -> None:
    a = featurize("Make day 2 less busy and add a tea ceremony", ["Plan 3 days in Kyoto"], fake_embed)
    b = featurize("How do I descale a kettle?", [], fake_embed)
    assert a.shape == b.shape and a.shape[0] > DIM
    assert np.isfinite(a).all() and np.isfinite(b).all()
    assert a[DIM + 3] == 1.0 and b[DIM + 3] == 0.0  # has-context flag
    # The standardised block starts right after the embedding and ends where the n-grams begin.
    dense = standardised_columns(a.shape[0])
    assert dense.start == DIM and dense.stop == a.shape[0] - TURN_NGRAM_BUCKETS - CONTEXT_NGRAM_BUCKETS


def test_training_is_deterministic_and_learns(small_set) -> None:  # type: ignore[no-untyped-def]
    m1, r1 = train(small_set, fake_embed, lopo=True, steps=150)
    m2, r2 = train(small_set, fake_embed, lopo=True, steps=150)
    for head in HEADS:
        assert np.array_equal(m1.heads[head].weights, m2.heads[head].weights)
    assert r1 == r2
    # On its own training turns it fits well beyond the majority class of every head.
    for field, acc in r1["train"]["accuracy"].items():
        majority = max(
            sum(t.labels[field] == v for t in small_set) for v in {t.labels[field] for t in small_set}
        ) / len(small_set)
        assert acc >= majority, field
    assert set(r1["lopo"]["accuracy"]) == set(r1["train"]["accuracy"])


def test_model_file_round_trip_and_refusals(small_set, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, _ = train(small_set, fake_embed, lopo=False, steps=50)
    path = tmp_path / "m.npz"
    model.save(path)
    loaded = LearnedModel.load(path)
    x = featurize(small_set[3].text, small_set[3].context, fake_embed)
    assert loaded.predict(x).keys() == model.predict(x).keys()
    assert {h: loaded.predict(x)[h][0] for h in HEADS} == {h: model.predict(x)[h][0] for h in HEADS}
    with pytest.raises(ModelFileError, match="cannot load"):
        LearnedModel.load(tmp_path / "missing.npz")
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelFileError):
        LearnedModel.load(corrupt)
    model.meta["features"] = "some-other-features"
    model.save(tmp_path / "foreign.npz")
    with pytest.raises(ModelFileError, match=FEATURES_VERSION):
        LearnedModel.load(tmp_path / "foreign.npz")


def test_guarded_learned_state_is_valid_and_costs_nothing(small_set) -> None:  # type: ignore[no-untyped-def]
    model, _ = train(small_set, fake_embed, lopo=False, steps=50)
    guard = GuardedEstimator(LearnedController(model, fake_embed), deadline_s=5.0)
    state = asyncio.run(guard.estimate("Rewrite the intro to be shorter", ["Draft my thesis intro"]))
    assert state.usage.backend == "learned" and not state.usage.llm_called
    assert state.usage.cost_usd == 0 and state.usage.fallback_reason == ""
    assert state.action in (ev.MATCH, ev.NEW_TOPIC) and state.top_k_hint in (3, 5, 8)
    if state.taxonomy.need_memory == 0:
        assert state.taxonomy.memory_span == ev.NONE and state.lens_recommendation == 0


class FakeEmbedder:
    dim = DIM

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return fake_embed(texts)


def test_a_forget_drops_the_controllers_cached_turn_embeddings(small_set) -> None:  # type: ignore[no-untyped-def]
    from mars.retrieval.embedder import LruEmbedder

    model, _ = train(small_set, fake_embed, lopo=False, steps=10)
    cache = LruEmbedder(FakeEmbedder())
    guard = GuardedEstimator(LearnedController(model, cache.encode, cache.clear), deadline_s=5.0)
    asyncio.run(guard.estimate("My ferry leaves from pier 4", ["Plan my island trip"]))
    # The turn and its context are cached by text, a forgotten user's among them: all go.
    assert guard.forget_cached() == 2
    assert guard.forget_cached() == 0
    assert GuardedEstimator(None).forget_cached() == 0  # the rules cache nothing


def test_state_service_falls_back_to_rules_without_a_model(tmp_path: Path) -> None:
    missing = make_estimator(
        StateSettings(qtm_backend="learned", qtm_learned_model=str(tmp_path / "none.npz"))
    )
    assert missing.controller is None and "cannot load" in missing.model_error
    state = asyncio.run(missing.estimate("Plan a trip to Kyoto", []))
    assert state.usage.backend == "" or state.usage.backend == "rules" or not state.usage.llm_called
    (tmp_path / "bad.npz").write_bytes(b"not a model")
    bad = make_estimator(StateSettings(qtm_backend="learned", qtm_learned_model=str(tmp_path / "bad.npz")))
    assert bad.controller is None and bad.model_error


def test_the_packaged_model_is_for_these_features() -> None:
    model = LearnedModel.load(DEFAULT_MODEL)
    assert model.meta["features"] == FEATURES_VERSION and model.meta["version"] == "qtm-learned-v2.1"
    assert (
        model.meta["turns"] >= 1000 and model.features == featurize("x", [], fake_embed).shape[0] - DIM + 384
    )


def test_ngram_buckets_are_the_same_in_every_process_and_carry_the_wording() -> None:
    a = hashed_ngrams("is that still under budget?", 256)
    assert a.sum() > 5 and set(np.unique(a)) <= {0.0, 1.0}
    # blake2b, not hash(): fixed buckets. Two processes with different string-hash seeds set the same ones,
    # which a hash()-based bucket would not (PYTHONHASHSEED moves every str hash).
    code = (
        "import json; from mars_state.qtm.learned import hashed_ngrams; "
        "print(json.dumps(hashed_ngrams('is that still under budget?', 256).nonzero()[0].tolist()))"
    )
    first, second = across_processes(code)
    assert first == second == a.nonzero()[0].tolist()
    assert not np.array_equal(a, hashed_ngrams("that is still under budget?", 256))  # first words differ
    assert hashed_ngrams("", 64).sum() == 0
    # The turn's n-grams and the previous turn's are both in the features.
    f1 = featurize("swap day 2 and 3", ["plan kyoto"], fake_embed)
    f2 = featurize("swap day 2 and 3", ["check the budget"], fake_embed)
    tail = TURN_NGRAM_BUCKETS + CONTEXT_NGRAM_BUCKETS
    assert np.array_equal(f1[-tail:-CONTEXT_NGRAM_BUCKETS], f2[-tail:-CONTEXT_NGRAM_BUCKETS])
    assert not np.array_equal(f1[-CONTEXT_NGRAM_BUCKETS:], f2[-CONTEXT_NGRAM_BUCKETS:])


def test_leave_one_persona_out_can_score_some_personas_only(small_set) -> None:  # type: ignore[no-untyped-def]
    from mars_tools.train_cli import features_of, leave_one_persona_out

    x = features_of(small_set, fake_embed)
    held = leave_one_persona_out(x, small_set, scored=["p02"], steps=30)
    assert [p is not None for p in held] == [t.persona == "p02" for t in small_set]
    _, report = train(small_set, fake_embed, lopo=True, scored=["p02"], steps=30)
    assert report["lopo"]["turns"] == sum(t.persona == "p02" for t in small_set)


def test_session_starts_train_the_action_head_and_are_scored_per_held_out_persona(small_set) -> None:  # type: ignore[no-untyped-def]
    from mars_tools.train_cli import SessionStart

    starts = [
        SessionStart(
            f"rm{p}", f"new project {p}-{i}: plan the launch", ("old notes on the budget",), i % 2 == 0
        )
        for p in range(3)
        for i in range(4)
    ]
    model, report = train(small_set, fake_embed, lopo=True, starts=starts, steps=50)
    r = report["realmem_lopo"]
    assert r["starts"] == 12 and r["new_topic"] == 6
    assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
    # The starts label the action head only: the other heads saw the labelled turns alone.
    assert set(model.heads) == set(HEADS)
