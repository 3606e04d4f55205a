import json
from pathlib import Path

import numpy as np
import pytest
from mars_tools.bench.locomo import load_locomo, parse_evidence, score_question


def test_evidence_ids_are_parsed_leniently() -> None:
    assert parse_evidence(["D1:3", "D8:6; D9:17"]) == {"D1:3", "D8:6", "D9:17"}
    assert parse_evidence("D2:1") == {"D2:1"}
    assert parse_evidence(["garbage"]) == frozenset()


def test_turn_and_session_recall() -> None:
    ranked = ["D1:1", "D2:5", "D1:2", "D3:1", "D2:1"]
    scores = score_question(ranked, frozenset({"D1:2", "D3:1"}))
    assert scores["turn@5"] == 1.0
    # sessions by best turn: 1, 2, 3 -> evidence sessions {1, 3}
    assert scores["session@1"] == 0.5
    assert scores["session@3"] == 1.0
    only_late = score_question(["D2:1"] * 1 + [f"D4:{i}" for i in range(30)] + ["D1:2"], frozenset({"D1:2"}))
    assert only_late["turn@20"] == 0.0


def test_loader_counts_sessions_by_key_and_drops_questions_without_evidence(tmp_path: Path) -> None:
    data = [
        {
            "sample_id": "c1",
            "conversation": {
                "speaker_a": "A",
                "session_1_date_time": "1 May",
                "session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "hi"}],
                "session_2": [{"speaker": "B", "dia_id": "D2:1", "text": "yo", "blip_caption": "a dog"}],
                "session_2_date_time": "2 May",
            },
            "qa": [
                {"question": "q1", "evidence": ["D2:1"], "category": 4},
                {"question": "q2", "evidence": [], "category": 5},
            ],
        }
    ]
    path = tmp_path / "l.json"
    path.write_text(json.dumps(data))
    (conv,) = load_locomo(path)
    assert [t.dia_id for t in conv.turns] == ["D1:1", "D2:1"]
    assert conv.turns[0].text.startswith("[1 May] A: hi")
    assert "a dog" in conv.turns[1].text
    assert [q.question for q in conv.questions] == ["q1"]
    with pytest.raises(ValueError, match="without evidence"):
        score_question([], frozenset())


class _Recording:
    """An embedder (a pure-logic stand-in) that records what it embedded: words hashed into 8 dimensions."""

    dim = 8

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, texts: list[str]) -> np.ndarray:
        self.texts += list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in text.lower().split():
                out[i, sum(map(ord, word)) % self.dim] += 1.0
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_stored_turns_and_questions_are_embedded_by_their_own_embedders(tmp_path: Path) -> None:
    """--stored-precision: the turns go through the stored embedder, the questions through the other."""
    from mars_tools.bench.locomo import run
    from rich.console import Console

    data = [
        {
            "sample_id": "c1",
            "conversation": {
                "speaker_a": "A",
                "session_1_date_time": "1 May",
                "session_1": [
                    {"speaker": "A", "dia_id": "D1:1", "text": "my dog is called Rex"},
                    {"speaker": "B", "dia_id": "D1:2", "text": "I bake bread on Sundays"},
                ],
            },
            "qa": [{"question": "what is the dog called", "evidence": ["D1:1"], "category": 4}],
        }
    ]
    path = tmp_path / "l.json"
    path.write_text(json.dumps(data))
    conversations = load_locomo(path)
    questions, stored = _Recording(), _Recording()
    results = run(conversations, questions, Console(file=None, quiet=True), stored)
    assert any("Rex" in t for t in stored.texts) and not any("Rex" in t for t in questions.texts)
    assert "what is the dog called" in questions.texts
    assert "what is the dog called" not in stored.texts
    assert results[4][0]["turn@5"] == 1.0
    # --ranker: the same questions ranked again with the packaged learned ranker, in the same run.
    from mars.retrieval.ranker import load_ranker

    ranker, why = load_ranker()
    assert ranker is not None, why
    ranked: dict[int, list[dict[str, float]]] = {}
    again = run(conversations, questions, Console(file=None, quiet=True), stored, ranker, ranked)
    assert again == results
    assert ranked[4][0]["turn@5"] == 1.0 and len(ranked[4]) == 1
