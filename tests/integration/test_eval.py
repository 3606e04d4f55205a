"""`mars eval realmem` / `mars eval locomo` against the real stack: recorded history is imported and queries
go through the gRPC ingress, metrics come from the views the pipeline logged on the broker, answers are saved
for a judge."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mars_stack import LocalStack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def eval_stack(standin_stack: LocalStack) -> LocalStack:
    """The stand-in stack shared with test_feedback and test_replay (conftest.standin_stack): no test here reads
    the answers' words; its tenants (ev1, ev2) are its own."""
    return standin_stack


def mars(*args: str, stack: LocalStack | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI; with `stack`, with its tools' Kafka login (it reads that stack's topics)."""
    exe = str(Path(sys.executable).parent / "mars")
    env = {**os.environ, **stack.kafka_env()} if stack is not None else None
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600, check=False, env=env)


def session(uuid: str, turns: list[dict[str, object]]) -> dict[str, object]:
    return {
        "session_uuid": uuid,
        "session_identifier": uuid,
        "current_time": "2025-01-01",
        "dialogue_turns": turns,
    }


def persona_file(folder: Path) -> None:
    dialogues = [
        session(
            "ferry",
            [
                {
                    "speaker": "User",
                    "content": "Plan the Lisbon ferry budget: forty euros for the Tagus ferry.",
                },
                {"speaker": "Assistant", "content": "Budget set: forty euros for the Tagus ferry in Lisbon."},
            ],
        ),
        session(
            "bread",
            [
                {"speaker": "User", "content": "Give me a sourdough starter feeding routine."},
                {"speaker": "Assistant", "content": "Feed the starter flour and water every morning."},
            ],
        ),
        session(
            "boots",
            [
                {"speaker": "User", "content": "Which hiking boots suit muddy mountain trails?"},
                {"speaker": "Assistant", "content": "Waterproof boots with deep lugs."},
            ],
        ),
        session(
            "now",
            [
                {
                    "speaker": "User",
                    "content": "What did we decide last time about the Lisbon ferry budget?",
                    "is_query": True,
                    "query_id": "Q-0001",
                },
                {"speaker": "Assistant", "content": "Forty euros.", "memory_session_uuids": ["ferry"]},
            ],
        ),
    ]
    (folder / "Tess_dialogues_256k.json").write_text(json.dumps({"dialogues": dialogues}))


def test_eval_realmem_scores_the_logged_views(eval_stack: LocalStack, tmp_path: Path) -> None:
    data = tmp_path / "realmem"
    data.mkdir()
    persona_file(data)
    out = tmp_path / "out"
    run = mars(
        "eval",
        "realmem",
        "--data",
        str(data),
        "--ingress",
        eval_stack.addr("ingress"),
        "--bootstrap",
        eval_stack.env["MARS_KAFKA_BOOTSTRAP"],
        "--postgres-dsn",
        eval_stack.env["MARS_POSTGRES_DSN"],
        "--tenant",
        "ev1",
        "--out",
        str(out),
        stack=eval_stack,
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    # The three earlier sessions are imported as recorded; only the scored query is sent.
    assert "turns sent 1, failed 0; recorded pairs imported 3" in " ".join(run.stdout.split())
    results = json.loads((out / "results.json").read_text())
    assert results["scored_queries"] == 1 and results["views_missing"] == 0
    assert results["pairs_imported"] == 3
    (pred,) = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    # The view's ranking holds earlier sessions only (never the query's own), the ferry session first.
    assert pred["query_id"] == "Q-0001"
    assert pred["retrieved"][0] == "ferry"
    assert "now" not in pred["retrieved"]
    assert set(pred["retrieved"]) <= {"ferry", "bread", "boots"}
    assert results["macro"]["recall_all@5"] == 1.0
    assert results["macro"]["ndcg_any@5"] == 1.0
    (answer,) = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert answer["reference_answer"] == "Forty euros."
    assert answer["answer"] and answer["model"] and not answer["error"]


def test_eval_locomo_maps_view_blocks_back_to_dialogue_ids(eval_stack: LocalStack, tmp_path: Path) -> None:
    conv = {
        "sample_id": "conv-t",
        "conversation": {
            "speaker_a": "Ana",
            "speaker_b": "Ben",
            "session_1_date_time": "1 May 2023",
            "session_1": [
                {"speaker": "Ana", "dia_id": "D1:1", "text": "I adopted a grey kitten named Pixel."},
                {"speaker": "Ben", "dia_id": "D1:2", "text": "I am repainting my garage door blue."},
            ],
            "session_2_date_time": "8 May 2023",
            "session_2": [
                {"speaker": "Ana", "dia_id": "D2:1", "text": "My cello recital went well on Friday."},
            ],
        },
        "qa": [
            {"question": "What did Ana adopt last time, the kitten?", "evidence": ["D1:1"], "category": 4},
            {"question": "No evidence here", "evidence": [], "category": 4},
        ],
    }
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([conv]))
    out = tmp_path / "out"
    run = mars(
        "eval",
        "locomo",
        "--data",
        str(path),
        "--ingress",
        eval_stack.addr("ingress"),
        "--bootstrap",
        eval_stack.env["MARS_KAFKA_BOOTSTRAP"],
        "--postgres-dsn",
        eval_stack.env["MARS_POSTGRES_DSN"],
        "--tenant",
        "ev2",
        "--out",
        str(out),
        stack=eval_stack,
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    # The three turns imported as recorded, the one scored question sent.
    assert results["turns_sent"] == 1 and results["turns_failed"] == 0 and results["turns_imported"] == 3
    assert results["questions"] == 1 and results["views_missing"] == 0
    row = results["by_category"]["4 single-hop"]
    assert row["n"] == 1
    assert row["turn@5"] == 1.0 and row["session@1"] == 1.0
    (answer,) = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert answer["evidence"] == ["D1:1"] and answer["answer"]


def test_eval_rejects_bad_input_with_a_clear_error(tmp_path: Path) -> None:
    run = mars("eval", "realmem", "--data", str(tmp_path / "nope"))
    assert run.returncode == 2 and "is not a folder" in " ".join(run.stdout.split())
    run = mars("eval", "locomo", "--data", str(tmp_path / "nope.json"))
    assert run.returncode == 2 and "is not a file" in " ".join(run.stdout.split())
    run = mars("eval", "locomo", "--data", str(tmp_path), "--max-tokens", "0")
    assert run.returncode == 2 and "must be an integer in 1..1024" in run.stderr
