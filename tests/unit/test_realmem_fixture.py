"""The synthetic RealMem-format persona the tests use instead of the public data: the committed file is
what its generator writes, and it parses as RealMem with scored queries and project-session starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mars_tools.bench.realmem import load_selected_personas
from mars_tools.probe.common import project_boundaries

FOLDER = Path(__file__).parents[1] / "fixtures" / "realmem"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "make_synthetic_persona", FOLDER / "make_synthetic_persona.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_fixture_matches_its_generator() -> None:
    gen = _generator()
    assert gen.OUT.read_text(encoding="utf-8") == gen.render()


def test_fixture_parses_as_realmem_with_gold_in_earlier_sessions() -> None:
    [persona] = load_selected_personas(FOLDER, ["Synth_Wanderer"])
    assert len(persona.sessions) == 14
    assert [q.query_id for q in persona.queries] == [f"Q-{i:04d}" for i in range(1, 6)]
    uuids = [s.uuid for s in persona.sessions]
    for q in persona.queries:
        assert q.gold and all(uuids.index(g) < q.session_position for g in q.gold)


def test_fixture_has_new_task_and_continuation_boundaries() -> None:
    bounds = list(project_boundaries(FOLDER / "Synth_Wanderer_dialogues_256k.json"))
    # 8 project sessions: 7 starts after the first; the probe scores NEW_TOPIC on both kinds of start.
    assert len(bounds) == 7
    assert [b.new_task for b in bounds] == [True, True, False, True, False, True, False]
