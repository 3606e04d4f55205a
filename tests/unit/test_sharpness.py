"""The table of deliberately broken copies (tests/sharpness) stays true to the code, and its runner really
tells a caught mutant from a missed one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "sharpness"))

from check_mutants import main as run_mutants  # noqa: E402
from mutants import MUTANTS, Mutant  # noqa: E402


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_breaks_one_place_and_names_a_test_that_exists(mutant: Mutant) -> None:
    text = (REPO / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.path} no longer holds the text {mutant.name} breaks"
    assert mutant.new != mutant.old and mutant.cost in {"unit", "stack", "k8s"}
    module, _, function = mutant.test.partition("::")
    tree = ast.parse((REPO / module).read_text())
    assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, mutant.test


def test_names_are_unique() -> None:
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def test_the_runner_catches_a_unit_mutant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The QTM's n-gram buckets by hash(): the test that runs two processes with different hash seeds fails.
    assert run_mutants(["--only", "ngram-buckets-by-hash", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "caught" in out
    log = (tmp_path / "ngram-buckets-by-hash.log").read_text()
    assert "1 failed" in log and "test_ngram_buckets_are_the_same_in_every_process" in log
