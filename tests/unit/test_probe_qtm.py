"""Pure parts of the QTM sensitivity probe: statistics, configs, snapshots and boundary labels."""

from __future__ import annotations

from pathlib import Path

import pytest
from fresh_process import across_processes
from mars_tools.bench.realmem import Session, Turn, load_persona
from mars_tools.probe.qtm import (
    ControllerConfig,
    Snapshot,
    _pairs_before,
    jaccard,
    pick_snapshots,
    project_boundaries,
    turn_pairs,
)
from mars_tools.stats import wilson_interval

TINY = Path(__file__).parent / "fixtures" / "realmem_tiny.json"


def test_wilson_interval_matches_hand_computed_values() -> None:
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_jaccard() -> None:
    assert jaccard(["a", "b"], ["b", "c"]) == pytest.approx(1 / 3)
    assert jaccard([], []) == 1.0 and jaccard(["a"], []) == 0.0


def test_controller_config_parsing() -> None:
    assert ControllerConfig.parse("rules").label() == "rules"
    c = ControllerConfig.parse("backend=llamacpp,prompt=qtm-v1-reordered,deadline_ms=500")
    assert (c.backend, c.prompt, c.deadline_ms, c.label()) == (
        "llamacpp",
        "qtm-v1-reordered",
        500,
        "llamacpp:qtm-v1-reordered",
    )
    with pytest.raises(ValueError, match="unknown controller setting"):
        ControllerConfig.parse("backend=rules,temperature=1")
    with pytest.raises(ValueError, match="unknown QTM backend"):
        ControllerConfig.parse("backend=gpt")


def test_turn_pairs_and_active_thread_prefix() -> None:
    session = Session(
        "s",
        0,
        "",
        (Turn("User", "a"), Turn("Assistant", "b"), Turn("User", "c"), Turn("Assistant", "d")),
    )
    assert turn_pairs(session) == ["User: a\nAssistant: b", "User: c\nAssistant: d"]
    snap = Snapshot("p", "q", "c", 0, ("a",))
    assert _pairs_before(turn_pairs(session), snap) == 1
    assert _pairs_before(turn_pairs(session), Snapshot("p", "q", "a", 0, ())) == 0


def test_snapshots_are_deterministic_and_bounded() -> None:
    persona = load_persona(TINY)
    all_snaps = pick_snapshots([persona], 100, None)
    assert len(all_snaps) == len(persona.queries)
    two = pick_snapshots([persona], 2, None)
    assert two == [all_snaps[0], all_snaps[len(all_snaps) // 2]]  # spread evenly over the timeline
    # The same persona file read in other processes (other string-hash seeds) gives the same snapshots.
    code = (
        "import json; from mars_tools.bench.realmem import load_persona; "
        "from mars_tools.probe.qtm import pick_snapshots; "
        f"print(json.dumps([s.query_id for s in pick_snapshots([load_persona({str(TINY)!r})], 2, None)]))"
    )
    assert across_processes(code) == [[s.query_id for s in two]] * 2
    assert all(s.session_position < 2 for s in pick_snapshots([persona], 100, 2))


def test_boundaries_skip_distractors_and_label_task_changes() -> None:
    got = [(b.session_uuid, b.new_task) for b in project_boundaries(TINY)]
    # Travel -> (distractor skipped) Fitness (new) -> Travel (new) -> Fitness (new).
    assert got == [("cccc0003", True), ("dddd0004", True), ("eeee0005", True)]
    first = next(project_boundaries(TINY))
    assert first.previous_turns and first.first_user_turn
