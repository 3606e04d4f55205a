"""`mars probe qtm` and `mars probe qtm-boundaries` on the project's synthetic RealMem-format persona
(tests/fixtures/realmem) at a small N, with the rules backend against the real local llama.cpp controller
(started by the probe itself). The public RealMem data is for benchmark runs (`--data`), not for tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: Made by tests/fixtures/realmem/make_synthetic_persona.py: 14 sessions, 3 projects, 5 scored queries.
REALMEM = Path(__file__).parents[1] / "fixtures" / "realmem"
PERSONA = "Synth_Wanderer"
#: One snapshot and one boundary per run: each llama.cpp answer (a 600 to 750-token prompt, a grammar) takes
#: 10 to 15 s of a core here, and a second one would run the same code and grammar again.


def realmem_dir() -> Path:
    return REALMEM


def mars(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "mars"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_probe_qtm_rules_vs_llamacpp(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    run = mars(
        "probe", "qtm", "--data", str(realmem_dir()), "--snapshots", "1", "--personas", PERSONA,
        "--max-sessions", "20", "--a", "rules", "--b", "backend=llamacpp,prompt=qtm-v1-paraphrased",
        "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["configs"] == ["rules", "llamacpp:qtm-v1-paraphrased"]
    assert result["overall"]["n"] == 1 and len(result["snapshots"]) == 1
    lo, hi = result["overall"]["wilson95"]
    assert 0.0 <= lo <= result["overall"]["action_agreement"] <= hi <= 1.0
    assert 0.0 <= result["overall"]["jaccard_mean"] <= 1.0
    # The controller answered every snapshot itself (schema-constrained), no fallback.
    assert result["outcomes"][1].get("ok", 0) + result["outcomes"][1].get("clamped", 0) == 1
    assert "Wilson 95%" in run.stdout


def test_probe_boundaries_scores_each_backend(tmp_path: Path) -> None:
    out = tmp_path / "boundaries.json"
    run = mars(
        "probe", "qtm-boundaries", "--data", str(realmem_dir()), "--personas", PERSONA, "--limit", "1",
        "--configs", "rules", "backend=llamacpp", "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"rules", "llamacpp:qtm-v1"}
    for r in report.values():
        assert r["tp"] + r["fn"] == report["rules"]["tp"] + report["rules"]["fn"]  # same ground truth
        assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["recall"] <= 1.0
    assert report["llamacpp:qtm-v1"]["outcomes"].get("endpoint_error", 0) == 0


def test_probe_rejects_bad_config_clearly(tmp_path: Path) -> None:
    run = mars("probe", "qtm", "--data", str(tmp_path), "--a", "rules", "--b", "backend=gpt")
    assert run.returncode == 2 and "unknown QTM backend" in run.stdout and "Traceback" not in run.stderr
