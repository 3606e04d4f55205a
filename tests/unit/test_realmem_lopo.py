"""`mars bench realmem-lopo`: the pure leave-one-persona-out selection on hand-made scores, the grid, and
the command end to end on the project's synthetic RealMem persona (real MiniLM embedder, real FAISS)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mars.retrieval.embedder import SentenceTransformerEmbedder
from mars.retrieval.hybrid import POLICY_CONFIGS
from mars_tools.bench.policies import CachingEmbedder, make_retriever
from mars_tools.bench.realmem import evaluate, load_selected_personas, replay
from mars_tools.bench.realmem_lopo import (
    FULL_LEVELS,
    TUNED,
    fusion_grid,
    grid_scores,
    leave_one_persona_out,
    tuned_name,
)
from mars_tools.cli import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "realmem" / "Synth_Wanderer_dialogues_256k.json"


def _v(x: float) -> dict[str, float]:
    """Metric values whose objective (mean of R_all@20 and nDCG@20) is x."""
    return {"recall_all@20": x, "ndcg_any@20": x, "recall_all@5": x / 2}


def test_lopo_choice_and_figure_on_hand_made_scores_is_below_in_sample() -> None:
    # "spiky" is best on all three (0.633 vs 0.6) only thanks to p1; held out on p1 it cannot be chosen.
    scores = {
        "spiky": {"p1": _v(0.9), "p2": _v(0.5), "p3": _v(0.5)},
        "steady": {"p1": _v(0.6), "p2": _v(0.6), "p3": _v(0.6)},
    }
    result = leave_one_persona_out(scores)
    assert [(f.held_out, f.chosen) for f in result.folds] == [
        ("p1", "steady"),
        ("p2", "spiky"),
        ("p3", "spiky"),
    ]
    assert [f.train_objective for f in result.folds] == pytest.approx([0.6, 0.7, 0.7])
    assert [f.held_out_values["recall_all@20"] for f in result.folds] == [0.6, 0.5, 0.5]
    assert result.lopo_macro["recall_all@20"] == pytest.approx(1.6 / 3)
    assert result.lopo_macro["recall_all@5"] == pytest.approx(0.8 / 3)
    assert result.in_sample_best == "spiky"
    assert result.in_sample_macro["ndcg_any@20"] == pytest.approx(1.9 / 3)
    assert result.lopo_macro["ndcg_any@20"] < result.in_sample_macro["ndcg_any@20"]


def test_objective_weighs_recall_and_ndcg_equally() -> None:
    # a: R_all 0.8, nDCG 0.4 (0.6); b: R_all 0.5, nDCG 0.65 (0.575): recall alone or nDCG alone would differ.
    a = {"recall_all@20": 0.8, "ndcg_any@20": 0.4}
    b = {"recall_all@20": 0.5, "ndcg_any@20": 0.65}
    result = leave_one_persona_out({"b": {"x": b, "y": b}, "a": {"x": a, "y": a}})
    assert {f.chosen for f in result.folds} == {"a"} and result.in_sample_best == "a"


def test_ties_go_to_the_earlier_configuration() -> None:
    same = {"p": _v(0.5), "q": _v(0.5)}
    assert leave_one_persona_out({"first": same, "second": dict(same)}).in_sample_best == "first"
    assert {f.chosen for f in leave_one_persona_out({"first": same, "second": same}).folds} == {"first"}


def test_bad_score_tables_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least 2 personas"):
        leave_one_persona_out({"a": {"only": _v(0.5)}})
    with pytest.raises(ValueError, match="other personas"):
        leave_one_persona_out({"a": {"p": _v(0.5), "q": _v(0.5)}, "b": {"p": _v(0.5), "r": _v(0.5)}})
    with pytest.raises(ValueError, match="no configurations"):
        leave_one_persona_out({})


def test_grids_hold_the_tuned_config_and_vary_only_fusion_settings() -> None:
    full, small = fusion_grid("full"), fusion_grid("small")
    # 3 levels of 4 weights x rrf_k {30, 60}.
    assert len(full) == 3**4 * 2 and len(small) == 4
    assert len(set(full.values())) == len(full)
    assert tuned_name(full) is not None and tuned_name(small) is not None
    assert full[tuned_name(full) or ""] == POLICY_CONFIGS["mars"]
    memory_level = {(c.bm25_k1, c.bm25_b, c.max_chunk_words, c.fusion) for c in full.values()}
    assert memory_level == {(TUNED.bm25_k1, TUNED.bm25_b, TUNED.max_chunk_words, "rrf")}
    assert {c.context_weight for c in full.values()} == {m * TUNED.context_weight for m in FULL_LEVELS}
    assert {c.prf_top for c in full.values()} == {TUNED.prf_top}
    with pytest.raises(ValueError, match="unknown grid"):
        fusion_grid("huge")


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(device="cpu")


def test_grid_scores_of_the_tuned_config_equal_the_mars_policy_replay(
    embedder: SentenceTransformerEmbedder,
) -> None:
    # One replay per persona ranks under every configuration; the tuned one must score exactly as the
    # `mars` policy of `mars bench realmem` does on its own replay.
    personas = load_selected_personas(FIXTURE.parent, ["Synth_Wanderer"])
    grid = fusion_grid("small")
    scores = grid_scores(personas, grid, CachingEmbedder(embedder), embedder)
    [persona] = personas
    alone = evaluate(personas, replay(persona, make_retriever("mars", CachingEmbedder(embedder), embedder)))
    assert scores[tuned_name(grid) or ""][persona.name] == alone.per_persona[persona.name].values
    # The grid's configurations do rank differently (else the selection would be vacuous).
    assert len({json.dumps(s, sort_keys=True) for s in scores.values()}) > 1


def _two_personas(tmp_path: Path) -> Path:
    """A data folder holding the synthetic persona twice, as personas A and B (LOPO needs two)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("A", "B"):
        shutil.copy(FIXTURE, data / f"{name}_dialogues_256k.json")
    return data


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return int(exit_info.value.code or 0)


def test_command_end_to_end_on_two_synthetic_personas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _two_personas(tmp_path)
    out = tmp_path / "lopo.json"
    code = _run(
        [
            "bench", "realmem-lopo", "--data", str(data), "--cache-dir", str(tmp_path / "cache"),
            "--grid", "small", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert [f["held_out"] for f in report["folds"]] == ["A", "B"]
    assert set(report["scores"]) == set(fusion_grid("small")) and report["personas"] == ["A", "B"]
    # Two copies of one persona: each fold chooses on an identical persona, so LOPO equals in-sample.
    assert {f["chosen"] for f in report["folds"]} == {report["in_sample_best"]["config"]}
    assert report["lopo_macro"] == pytest.approx(report["in_sample_best"]["macro"])
    assert report["tuned_in_sample"]["config"] == tuned_name(fusion_grid("small"))
    assert (tmp_path / "cache" / "embeddings.npz").exists()
    printed = capsys.readouterr().out
    assert "LOPO" in printed and "in-sample best" in printed


def test_one_persona_cannot_be_held_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["bench", "realmem-lopo", "--data", str(FIXTURE.parent), "--grid", "small"]) == 2
    printed = capsys.readouterr().out
    assert "at least 2 personas" in printed and "Synth_Wanderer" in printed
    assert "Traceback" not in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "/nonexistent/realmem"], "is not a folder"),
        (["--data", str(FIXTURE.parent), "--personas", "Nobody"], "unknown persona"),
        (["--data", "{tmp}"], "no *_dialogues_256k.json"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _run(["bench", "realmem-lopo", *argv]) == 2
    assert message in capsys.readouterr().out


def test_missing_out_folder_is_reported_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _two_personas(tmp_path)
    code = _run(["bench", "realmem-lopo", "--data", str(data), "--out", str(tmp_path / "no" / "x.json")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().out
