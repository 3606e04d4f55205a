"""`mars probe qtm-labels` (mars_tools.probe.qtm_labels): the labelled set's gold context, validation, scoring,
and a run of the rules backend end to end on a small set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mars.v1 import events_pb2 as ev
from mars_state.qtm.labelled import (
    DEFAULT_LABELS,
    FIELDS,
    LabelError,
    consistency_problems,
    load_labelled,
    state_labels,
)
from mars_tools.cli import build_parser
from mars_tools.probe.qtm_labels import score

BASE = {
    "action": "MATCH",
    "query_type": "DYNAMIC",
    "phase": "REVISE",
    "need_memory": 1,
    "memory_span": "ACTIVE_THREAD",
    "retrieval_scope": "LOCAL",
    "ambiguity": "LOW",
}


def line(session: str, index: int, text: str, **labels: object) -> str:
    return json.dumps(
        {"persona": session.split("-")[0], "session": session, "index": index, "text": text,
         "labels": {**BASE, **labels}}
    )  # fmt: skip


SET = [
    line("p1-s1", 0, "Plan a three day Kyoto trip", action="NEW_TOPIC", phase="EXPLORE", need_memory=0,
         memory_span="NONE", query_type="STATIC"),
    line("p1-s1", 1, "Make day 2 less busy and add a tea ceremony"),
    line("p1-s1", 2, "How do I descale a kettle?", action="NEW_TOPIC", phase="EXPLORE", need_memory=0,
         memory_span="NONE", query_type="STATIC"),
    line("p1-s1", 3, "And with vinegar?"),
    line("p1-s2", 0, "Back to my Kyoto trip: what did we plan for day 2?", query_type="TEMPORAL", phase="VERIFY",
         memory_span="CROSS_SESSION", retrieval_scope="GLOBAL"),
]  # fmt: skip


def test_gold_context_is_the_persona_thread_before_the_turn() -> None:
    turns = load_labelled(SET)
    by_text = {t.text: t for t in turns}
    assert by_text["Plan a three day Kyoto trip"].context == ()
    assert by_text["Make day 2 less busy and add a tea ceremony"].context == ("Plan a three day Kyoto trip",)
    # A new topic is seen with the thread it leaves (that switch is what a controller must detect) ...
    assert by_text["How do I descale a kettle?"].context == (
        "Plan a three day Kyoto trip",
        "Make day 2 less busy and add a tea ceremony",
    )
    # ... and starts a new thread.
    assert by_text["And with vinegar?"].context == ("How do I descale a kettle?",)
    # The thread carries into the persona's next session (the state service keeps one per user); sessions
    # go in number order, s10 after s2.
    assert by_text["Back to my Kyoto trip: what did we plan for day 2?"].context == (
        "How do I descale a kettle?",
        "And with vinegar?",
    )
    later = load_labelled([*SET, line("p1-s10", 0, "Later")])
    assert [t.session for t in later][-1] == "p1-s10"


def test_bad_lines_are_refused_with_their_line_number() -> None:
    with pytest.raises(LabelError, match=r"line 2: phase='DREAM'"):
        load_labelled([SET[0], line("p1-s1", 1, "x", phase="DREAM")])
    with pytest.raises(LabelError, match="line 1: KeyError"):
        load_labelled([json.dumps({"persona": "p", "session": "s", "index": 0, "text": "t", "labels": {}})])
    with pytest.raises(LabelError, match="line 1"):
        load_labelled(["{not json"])


def test_score_counts_each_field_and_its_confusions() -> None:
    gold = [{f: v[0] for f, v in FIELDS.items()}, {f: v[1] for f, v in FIELDS.items()}]
    predicted = [dict(gold[0]), {**gold[1], "phase": "EXPLORE"}]
    result = score(gold, predicted)
    assert result["accuracy"]["phase"] == 0.5 and result["accuracy"]["action"] == 1.0
    assert result["confusion"]["phase"] == {"EXPLORE->EXPLORE": 1, "CONSTRAIN->EXPLORE": 1}


def test_state_labels_speak_the_sets_terms() -> None:
    state = ev.SessionState(
        action=ev.NEW_TOPIC, query_type=ev.TEMPORAL, phase=ev.VERIFY, retrieval_scope=ev.GLOBAL,
        taxonomy=ev.Taxonomy(need_memory=1, memory_span=ev.CROSS_SESSION, ambiguity=ev.HIGH),
    )  # fmt: skip
    assert state_labels(state) == {
        "action": "NEW_TOPIC", "query_type": "TEMPORAL", "phase": "VERIFY", "need_memory": "1",
        "memory_span": "CROSS_SESSION", "retrieval_scope": "GLOBAL", "ambiguity": "HIGH",
    }  # fmt: skip


def test_probe_runs_the_rules_on_a_labelled_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "turns.jsonl"
    labels.write_text("\n".join(SET) + "\n")
    out = tmp_path / "out.json"
    args = build_parser().parse_args(
        ["probe", "qtm-labels", "--labels", str(labels), "--configs", "rules", "--out", str(out)]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["turns"] == 5 and report["personas"] == 1
    assert set(report["rules"]["accuracy"]) == set(FIELDS)
    assert all(0.0 <= a <= 1.0 for a in report["rules"]["accuracy"].values())
    assert "5 labelled turns of 1 personas" in capsys.readouterr().out
    missing = build_parser().parse_args(["probe", "qtm-labels", "--labels", str(tmp_path / "nope.jsonl")])
    assert missing.func(missing) == 2


def test_the_shipped_set_keeps_the_guides_consistency_rules() -> None:
    turns = load_labelled(DEFAULT_LABELS.read_text().splitlines())
    assert consistency_problems(turns) == []
    assert len(turns) >= 1000 and len({t.persona for t in turns}) >= 30
    # Every Table 5 value of every field occurs at least 20 times.
    for field, values in FIELDS.items():
        for value in values:
            assert sum(t.labels[field] == value for t in turns) >= 20, (field, value)


def test_consistency_rules_name_the_turn_that_breaks_them() -> None:
    assert consistency_problems(load_labelled(SET)) == []
    broken = [
        line("p2-s1", 0, "Hi", action="MATCH", need_memory=0, memory_span="NONE"),  # rules 4 and 5
        line("p2-s1", 1, "Swap it", memory_span="NONE"),  # rule 1
        line("p2-s1", 2, "New thing", action="NEW_TOPIC", phase="VERIFY"),  # rule 3
        line("p2-s1", 3, "Old thing", memory_span="CROSS_SESSION"),  # rule 2
    ]
    problems = consistency_problems(load_labelled(broken))
    assert any(p.startswith("p2-s1#0: rule 4") for p in problems)
    assert any(p.startswith("p2-s1#0: rule 5") for p in problems)
    assert any(p.startswith("p2-s1#1: rule 1") for p in problems)
    assert any(p.startswith("p2-s1#2: rule 3") for p in problems)
    assert any(p.startswith("p2-s1#3: rule 2") for p in problems)


def test_agreement_of_a_second_annotator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "turns.jsonl"
    labels.write_text("\n".join(SET) + "\n")
    other = tmp_path / "other.jsonl"
    # The second annotator reads the revision as CONSTRAIN and agrees on everything else.
    other.write_text("\n".join([SET[0], line("p1-s1", 1, "Make day 2 less busy and add a tea ceremony",
                                              phase="CONSTRAIN")]) + "\n")  # fmt: skip
    out = tmp_path / "agreement.json"
    args = build_parser().parse_args(
        ["probe", "qtm-labels", "--labels", str(labels), "--agreement", str(other), "--out", str(out)]
    )
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["turns"] == 2 and result["accuracy"]["phase"] == 0.5 and result["accuracy"]["action"] == 1.0
    assert "second annotator" in capsys.readouterr().out
    stranger = tmp_path / "stranger.jsonl"
    stranger.write_text(line("p9-s1", 0, "not in the set") + "\n")
    args = build_parser().parse_args(
        ["probe", "qtm-labels", "--labels", str(labels), "--agreement", str(stranger)]
    )
    assert args.func(args) == 2
