"""`mars train ranker` end to end on the project's synthetic RealMem persona (real MiniLM embedder, real
FAISS): the recorded candidates are the `mars` policy's ranking, and the command reports and writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mars.retrieval.embedder import SentenceTransformerEmbedder
from mars.retrieval.ranker import FEATURE_NAMES, load_ranker
from mars_tools.bench.policies import CachingEmbedder, make_retriever
from mars_tools.bench.ranker_data import DEPTH, predictions, realmem_candidates
from mars_tools.bench.realmem import evaluate, load_selected_personas, replay
from mars_tools.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "realmem" / "Synth_Wanderer_dialogues_256k.json"


def test_recorded_candidates_are_the_mars_ranking() -> None:
    embedder = SentenceTransformerEmbedder()
    [persona] = load_selected_personas(FIXTURE.parent, ["Synth_Wanderer"])
    lists = realmem_candidates(persona, CachingEmbedder(embedder), embedder)
    assert lists and all(c.features.shape == (len(c.keys), len(FEATURE_NAMES)) for c in lists)
    assert any(c.gold.any() for c in lists)
    mars = replay(persona, make_retriever("mars", CachingEmbedder(embedder), embedder), DEPTH)
    by_query = {p.query_id: p.retrieved for p in mars}
    for c in lists:
        assert c.keys[:DEPTH] == by_query[c.query_id]
    fused = evaluate([persona], predictions(persona.name, lists, None))
    assert fused.pooled.values == evaluate([persona], mars).pooled.values


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return int(exit_info.value.code or 0)


def test_train_ranker_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("A", "B"):
        shutil.copy(FIXTURE, data / f"{name}_dialogues_256k.json")
    out, report = tmp_path / "ranker.json", tmp_path / "report.json"
    argv = ["train", "ranker", "--realmem", str(data), "--out", str(out), "--report", str(report)]
    assert _run([*argv, "--cache-dir", str(tmp_path / "cache")]) == 0
    ranker, why = load_ranker(out)
    assert ranker is not None, why
    figures = json.loads(report.read_text())
    for name in ("fused", "ranker"):
        assert set(figures["lopo"][name]) >= {"pooled", "macro", "A", "B"}
        assert 0.0 <= figures["lopo"][name]["pooled"]["recall_all@10"] <= 1.0
    # Both personas are the same file: the fused ranking scores alike on each.
    assert figures["lopo"]["fused"]["A"] == figures["lopo"]["fused"]["B"]
    assert figures["meta"]["personas"] == ["A", "B"] and figures["meta"]["realmem_queries"] > 0
    printed = capsys.readouterr().out
    assert "learned ranker, LOPO, pooled" in printed
    # Deterministic: trained again, the same model.
    again = tmp_path / "again.json"
    assert _run(["train", "ranker", "--realmem", str(data), "--out", str(again), "--no-lopo"]) == 0
    assert json.loads(again.read_text())["linear"] == pytest.approx(json.loads(out.read_text())["linear"], abs=1e-9)


def test_train_ranker_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["train", "ranker", "--realmem", str(FIXTURE.parent), "--out", str(tmp_path / "m.json")]) == 2
    assert "at least 2 personas" in capsys.readouterr().out
    assert _run(["train", "ranker", "--realmem", str(tmp_path / "nowhere")]) == 2
    assert _run(["train", "ranker", "--realmem", str(FIXTURE.parent), "--no-lopo", "--steps", "0"]) == 2
    printed = capsys.readouterr().out
    assert "--steps" in printed and "Traceback" not in printed
    assert not (tmp_path / "m.json").exists()


def test_train_ranker_weighs_locomo_and_records_the_weight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(FIXTURE, data / "A_dialogues_256k.json")
    turns = [
        {"speaker": "A", "dia_id": f"D1:{i + 1}", "text": text}
        for i, text in enumerate(["I booked the train to Lisbon", "My sister plays the cello", "We hiked in Sintra"])
    ]
    locomo = tmp_path / "locomo.json"
    locomo.write_text(
        json.dumps(
            [
                {
                    "sample_id": "c1",
                    "conversation": {"speaker_a": "A", "session_1_date_time": "1 May", "session_1": turns},
                    "qa": [{"question": "Where did A hike?", "evidence": ["D1:3"], "category": 1}],
                }
            ]
        )
    )
    argv = ["train", "ranker", "--realmem", str(data), "--locomo", str(locomo), "--no-lopo"]
    out = tmp_path / "ranker.json"
    assert _run([*argv, "--locomo-weight", "0.5", "--out", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["locomo_questions"] == 1 and meta["locomo_weight"] == 0.5
    assert _run([*argv, "--locomo-weight", "-1", "--out", str(tmp_path / "bad.json")]) == 2
    assert "--locomo-weight" in capsys.readouterr().out and not (tmp_path / "bad.json").exists()
