from mars.domain.thread_state import MAX_CONSTRAINTS, fold_turn, new_thread, render_active_state
from mars.v1 import events_pb2 as ev


def st(phase: int) -> ev.SessionState:
    return ev.SessionState(action=ev.MATCH, phase=phase)  # type: ignore[arg-type]


def test_artifact_versions_follow_revisions_not_exploration() -> None:
    t = new_thread("Write a cover letter for a data analyst job")
    t = fold_turn(
        t, 1, "Write a cover letter for a data analyst job", "Dear hiring manager, v1", st(ev.EXPLORE)
    )
    assert (t.version, t.artifact) == (1, "Dear hiring manager, v1")
    t = fold_turn(t, 2, "Is that a good opening?", "Yes, it is direct.", st(ev.VERIFY))
    assert t.version == 1 and t.artifact == "Dear hiring manager, v1"
    t = fold_turn(t, 3, "Make it shorter", "Dear manager, v2", st(ev.REVISE))
    assert (t.version, t.artifact, t.turns) == (2, "Dear manager, v2", 3)


def test_constraints_are_collected_and_capped() -> None:
    t = new_thread("plan a trip")
    for i in range(MAX_CONSTRAINTS + 2):
        t = fold_turn(t, i + 1, f"the budget must stay under {1000 + i} dollars", "ok", st(ev.CONSTRAIN))
    assert len(t.constraints) == MAX_CONSTRAINTS
    assert t.constraints[-1].endswith(f"{1000 + MAX_CONSTRAINTS + 1} dollars")
    assert "under 1000 dollars" not in " ".join(t.constraints)


def test_redelivered_turn_is_not_applied_twice() -> None:
    t = fold_turn(new_thread("x"), 5, "must be blue", "v1", st(ev.CONSTRAIN))
    assert fold_turn(t, 5, "must be blue", "v1", st(ev.CONSTRAIN)) == t
    assert fold_turn(t, 4, "older", "v0", st(ev.REVISE)) == t


def test_render_shows_title_constraints_and_latest_version() -> None:
    t = fold_turn(
        new_thread("Kyoto itinerary"), 1, "budget must be under 1500", "Day 1: temples", st(ev.CONSTRAIN)
    )
    text = render_active_state(t)
    assert text.startswith("Active thread: Kyoto itinerary (1 turn(s) so far).")
    assert "- budget must be under 1500" in text
    assert "Latest version (v1):\nDay 1: temples" in text
