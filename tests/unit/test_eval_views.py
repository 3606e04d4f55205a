"""Pure parts of `mars eval`: view blocks -> rankings, truncation, and the LoCoMo mapping."""

from __future__ import annotations

from mars.v1 import events_pb2 as ev
from mars_tools.bench.locomo import Conversation, LocomoQuestion, LocomoTurn
from mars_tools.bench.realmem import Persona, Query, Session, Turn
from mars_tools.eval import locomo as eval_locomo
from mars_tools.eval import realmem as eval_realmem
from mars_tools.eval.driver import SentTurn, distinct, shown_sources


def block(kind: int, session: str, turn: str = "", score: float = 0.0) -> ev.MemoryBlock:
    return ev.MemoryBlock(kind=kind, source_session_id=session, source_turn_id=turn, score=score)  # type: ignore[arg-type]


def view(*blocks: ev.MemoryBlock) -> ev.CandidateView:
    return ev.CandidateView(blocks=list(blocks))


def query(qid: str, position: int, gold: set[str]) -> Query:
    return Query("p", qid, f"text {qid}", position, frozenset(gold), None, "")


def test_shown_sources_puts_retrieved_history_first_and_drops_own_session_and_active_state() -> None:
    v = view(
        block(ev.ACTIVE_STATE, ""),
        block(ev.RECENT_TURN, "s3"),
        block(ev.RECENT_TURN, "own"),
        block(ev.RETRIEVED_HISTORY, "s1", score=0.9),
        block(ev.RETRIEVED_HISTORY, "own", score=0.8),
        block(ev.RETRIEVED_HISTORY, "s2", score=0.5),
    )
    assert [b.source_session_id for b in shown_sources(v, exclude_session="own")] == ["s1", "s2", "s3"]
    assert distinct(["a", "", "b", "a", "c", "b"]) == ["a", "b", "c"]


def test_predictions_from_views_rank_distinct_sessions_and_count_missing_views() -> None:
    answered = [
        eval_realmem.AnsweredQuery(query("Q1", 3, {"s1"}), SentTurn("own", "q", turn_id="t1"), "ref"),
        eval_realmem.AnsweredQuery(query("Q2", 3, {"s2"}), SentTurn("own", "q", turn_id="t2"), "ref"),
        eval_realmem.AnsweredQuery(query("Q3", 3, {"s2"}), SentTurn("own", "q", error="UNAVAILABLE: x"), ""),
    ]
    views = {
        "t1": view(
            block(ev.RETRIEVED_HISTORY, "s2"),
            block(ev.RETRIEVED_HISTORY, "s1"),
            block(ev.RETRIEVED_HISTORY, "s2"),
            block(ev.RETRIEVED_HISTORY, "own"),
        )
    }
    preds, missing = eval_realmem.predictions_from_views(answered, views)
    assert [(p.query_id, p.retrieved) for p in preds] == [("Q1", ["s2", "s1"])]
    assert missing == 2  # t2 has no logged view; Q3 failed before it got a turn id


def test_realmem_truncate_keeps_sessions_and_their_queries() -> None:
    sessions = [Session(f"s{i}", i, "", (Turn("User", f"u{i}"),)) for i in range(4)]
    persona = Persona("p", sessions, [query("Q1", 1, {"s0"}), query("Q2", 3, {"s1"})])
    cut = eval_realmem.truncate(persona, 2)
    assert [s.uuid for s in cut.sessions] == ["s0", "s1"]
    assert [q.query_id for q in cut.queries] == ["Q1"]
    assert eval_realmem.truncate(persona, None) is persona


def test_locomo_truncate_keeps_questions_whose_evidence_was_sent() -> None:
    turns = [LocomoTurn(f"D{s}:{t}", s, i, "x") for i, (s, t) in enumerate([(1, 1), (1, 2), (2, 1)])]
    questions = [
        LocomoQuestion("a", 1, frozenset({"D1:2"})),
        LocomoQuestion("b", 2, frozenset({"D1:1", "D2:1"})),
        LocomoQuestion("c", 4, frozenset({"D1:1"})),
    ]
    conv = Conversation("c1", turns, questions)
    cut = eval_locomo.truncate(conv, 1, None)
    assert [t.dia_id for t in cut.turns] == ["D1:1", "D1:2"]
    assert [q.question for q in cut.questions] == ["a", "c"]
    assert [q.question for q in eval_locomo.truncate(conv, None, 2).questions] == ["a", "b"]


def test_view_ranking_prefers_the_pre_packing_ranking_without_the_own_session() -> None:
    v = view(block(ev.RETRIEVED_HISTORY, "s9"), block(ev.RECENT_TURN, "s8"))
    assert eval_realmem.view_ranking(v, "own") == ["s9", "s8"]  # no ranking logged: the shown blocks
    v.ranking.extend(
        ev.RankedSession(record_id=r, session_id=s) for r, s in (("a", "s2"), ("b", "own"), ("c", "s1"))
    )
    assert eval_realmem.view_ranking(v, "own") == ["s2", "s1"]


class FakeDriver:
    """Records what drive_persona asks of the ingress (the real one is tested against the stack)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.imported = 0

    def import_history(self, turns: list[object]) -> list[str]:
        self.calls.append(("import", [(t.session_id, t.user_text, t.assistant_text) for t in turns]))  # type: ignore[attr-defined]
        return [f"imp-{i}" for i in range(len(turns))]

    def send(self, session_id: str, text: str) -> SentTurn:
        self.calls.append(("send", (session_id, text)))
        return SentTurn(session_id, text, turn_id=f"t-{text}", answer="a")


def test_drive_persona_imports_the_recorded_pairs_before_each_query_and_sends_only_queries() -> None:
    sessions = [
        Session("s0", 0, "", (Turn("User", "u1"), Turn("Assistant", "a1"), Turn("User", "u2"))),
        Session(
            "s1",
            1,
            "",
            (Turn("User", "u3"), Turn("Assistant", "a3"), Turn("User", "Q?"), Turn("Assistant", "ref")),
        ),
        Session("s2", 2, "", (Turn("User", "u4"), Turn("Assistant", "a4"))),
    ]
    q = Query("p", "Q1", "Q?", 1, frozenset({"s0"}), None, "")
    q2 = Query("p", "Q2", "u4", 2, frozenset({"s1"}), None, "")
    persona = Persona("p", sessions, [q, q2])
    driver = FakeDriver()
    answered = eval_realmem.drive_persona(driver, persona)  # type: ignore[arg-type]
    # Each query is asked (not remembered: the driver's options), then its recorded pair is imported.
    assert driver.calls == [
        ("import", [("s0", "u1", "a1"), ("s0", "u2", ""), ("s1", "u3", "a3")]),
        ("send", ("s1", "Q?")),
        ("import", [("s1", "Q?", "ref")]),
        ("send", ("s2", "u4")),
    ]
    assert [(a.query.query_id, a.sent.turn_id, a.reference_answer) for a in answered] == [
        ("Q1", "t-Q?", "ref"),
        ("Q2", "t-u4", "a4"),
    ]
    # Without import every user turn is sent, in order.
    driver = FakeDriver()
    eval_realmem.drive_persona(driver, persona, import_history=False)  # type: ignore[arg-type]
    assert [c[1][1] for c in driver.calls] == ["u1", "u2", "u3", "Q?", "u4"]  # type: ignore[index]
    assert {c[0] for c in driver.calls} == {"send"}
