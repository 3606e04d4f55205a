"""RealMem benchmark core: loader, strict scorer, averaging, replay leakage rule, baselines (tiny fixture)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mars_tools.bench.realmem import (
    Persona,
    Prediction,
    Query,
    QueryScore,
    RecentRetriever,
    Session,
    SessionBM25Retriever,
    Turn,
    aggregate,
    evaluate,
    format_table,
    load_persona,
    parse_persona,
    predictions_from_jsonl,
    predictions_to_jsonl,
    read_predictions,
    replay,
    score_query,
    write_predictions,
)

FIXTURE = Path(__file__).parent / "fixtures" / "realmem_tiny.json"
A, B, C, D, E = "aaaa0001", "bbbb0002", "cccc0003", "dddd0004", "eeee0005"
LOG2_3 = math.log2(3)


@pytest.fixture()
def persona() -> Persona:
    return load_persona(FIXTURE)


def pool_of(*ids: str) -> frozenset[str]:
    return frozenset(ids)


# ------------------------------------------------------------------------------------------------ loader


def test_loader_sessions_in_list_order_with_speaker_prefixed_text(persona: Persona) -> None:
    assert persona.name == "realmem_tiny"
    assert [s.uuid for s in persona.sessions] == [A, B, C, D, E]
    assert [s.position for s in persona.sessions] == [0, 1, 2, 3, 4]
    assert persona.sessions[1].time == "2025-12-16 (Tuesday)"
    assert persona.sessions[1].text == (
        "User: How long should sourdough bread proof overnight?\n"
        "Assistant: Around 12 hours in the fridge for sourdough."
    )


def test_loader_scores_only_is_query_turns_with_nonempty_known_gold(persona: Persona) -> None:
    # Q-0003 has an empty gold set; the non-query "Thanks" turn has a cited answer but is not scored.
    assert [q.query_id for q in persona.queries] == ["Q-0001", "Q-0002", "Q-0004"]
    q1, q2, q4 = persona.queries
    assert q1.gold == {A}
    assert q1.text == "Remind me, what budget did I set for the Lisbon trip?"  # stripped
    assert q1.session_position == 2 and q1.time == "2025-12-17 (Wednesday)"
    assert q1.previous_user_text == "Let's start a 16 week marathon training plan."
    assert q1.persona == "realmem_tiny"
    # memory_session_uuids is empty -> fallback to memory_used; the unknown zzzz9999 is dropped.
    assert q2.gold == {A, C}
    assert q2.previous_user_text is None
    # Self-citation is kept in gold (it is a known session), even though it is never in the pool.
    assert q4.gold == {C, E}
    assert q4.session_position == 4


def test_loader_prefers_memory_session_uuids_over_memory_used() -> None:
    data = json.loads(FIXTURE.read_text())
    # Q-0001's answer: memory_used cites A, memory_session_uuids now cites B -> B wins.
    data["dialogues"][2]["dialogue_turns"][3]["memory_session_uuids"] = [B]
    p = parse_persona("x", data)
    assert p.queries[0].gold == {B}
    # With no memory_session_uuids key at all, memory_used is the fallback.
    del data["dialogues"][2]["dialogue_turns"][3]["memory_session_uuids"]
    assert parse_persona("x", data).queries[0].gold == {A}


def test_loader_drops_query_when_next_turn_is_not_assistant() -> None:
    data = json.loads(FIXTURE.read_text())
    turns = data["dialogues"][2]["dialogue_turns"]
    turns[3]["speaker"] = "User"
    assert "Q-0001" not in [q.query_id for q in parse_persona("x", data).queries]


# ------------------------------------------------------------------------------------------------ scorer


def test_longmemeval_discount_ranks_one_and_two_weigh_the_same() -> None:
    s = score_query(["n1", "g"], frozenset({"g"}), pool_of("n1", "g"))
    assert s.recall_any[5] == 1.0 and s.recall_all[5] == 1.0
    assert s.ndcg_any[5] == pytest.approx(1.0)  # standard 1/log2(j+1) would give 0.6309
    s3 = score_query(["n1", "n2", "g"], frozenset({"g"}), pool_of("n1", "n2", "g"))
    assert s3.ndcg_any[5] == pytest.approx(1.0 / LOG2_3)


def test_recall_any_all_and_ndcg_hand_computed() -> None:
    gold = frozenset({"a", "b", "c"})
    ranked = ["a", "n1", "b", "n2", "n3", "c"]
    s = score_query(ranked, gold, pool_of(*ranked), ks=(1, 5, 10))
    assert (s.recall_any[1], s.recall_all[1], s.ndcg_any[1]) == (1.0, 0.0, 1.0)
    assert s.recall_any[5] == 1.0 and s.recall_all[5] == 0.0
    idcg = 1 + 1 + 1 / LOG2_3
    assert s.ndcg_any[5] == pytest.approx((1 + 1 / LOG2_3) / idcg)  # 0.6199
    assert s.recall_all[10] == 1.0
    assert s.ndcg_any[10] == pytest.approx((1 + 1 / LOG2_3 + 1 / math.log2(6)) / idcg)  # 0.7670
    assert s.leaks == 0 and s.duplicates == 0 and not s.missing


def test_no_hit_scores_zero() -> None:
    s = score_query(["n1", "n2"], frozenset({"g"}), pool_of("n1", "n2", "g"))
    assert all(v == 0.0 for d in (s.recall_any, s.recall_all, s.ndcg_any) for v in d.values())


def test_gold_larger_than_k() -> None:
    gold = frozenset(f"g{i}" for i in range(6))
    ranked = [f"g{i}" for i in range(6)]
    s = score_query(ranked, gold, gold)
    assert s.recall_all[5] == 0.0  # |G| > k: never all
    assert s.recall_any[5] == 1.0
    assert s.ndcg_any[5] == pytest.approx(1.0)  # IDCG over min(|G|, k) = 5 ones
    assert s.recall_all[10] == 1.0 and s.ndcg_any[10] == pytest.approx(1.0)


def test_duplicates_keep_first_and_waste_slots() -> None:
    s = score_query(["n", "n", "g"], frozenset({"g"}), pool_of("n", "g"))
    assert s.duplicates == 1
    assert s.ndcg_any[5] == pytest.approx(1 / LOG2_3)  # g stays at rank 3
    # A repeated gold id is relevant once: DCG 1 over IDCG 2 (an unchecked scorer would give 1.0).
    s2 = score_query(["g", "g"], frozenset({"g", "h"}), pool_of("g", "h"))
    assert s2.duplicates == 1
    assert s2.ndcg_any[5] == pytest.approx(0.5)
    assert s2.recall_all[5] == 0.0


def test_leaked_future_id_is_flagged_and_non_relevant() -> None:
    # "f" is gold but outside the pool (a future / own session): its slot stays and counts 0.
    gold = frozenset({"f", "g"})
    s = score_query(["f", "g", "zz"], gold, pool_of("g", "n"))
    assert s.leaks == 2 and s.leaked == ("f", "zz")
    assert s.recall_any[5] == 1.0
    assert s.recall_all[5] == 0.0  # gold outside the pool stays in G
    assert s.ndcg_any[5] == pytest.approx(1.0 / 2.0)  # g at rank 2 (weight 1) over IDCG 2
    # Leaked slots are kept, not dropped: g stays at rank 3 (dropping them would move it to rank 1).
    s2 = score_query(["x1", "x2", "g"], frozenset({"g"}), pool_of("g"))
    assert s2.leaks == 2
    assert s2.ndcg_any[5] == pytest.approx(1 / LOG2_3)


def test_missing_prediction_scores_zero() -> None:
    s = score_query(None, frozenset({"g"}), pool_of("g"))
    assert s.missing
    assert s.recall_any[20] == 0.0 and s.ndcg_any[20] == 0.0


# ------------------------------------------------------------------------------------------- aggregation


def _const(v: float) -> QueryScore:
    d = {5: v, 10: v, 20: v}
    return QueryScore(dict(d), dict(d), dict(d))


def test_macro_vs_pooled_averaging() -> None:
    res = aggregate({"p1": [_const(1.0)], "p2": [_const(0.0), _const(0.0), _const(0.0)]})
    assert res.per_persona["p1"].values["recall_all@20"] == 1.0
    assert res.per_persona["p2"].values["recall_all@20"] == 0.0
    assert res.macro.values["recall_all@20"] == pytest.approx(0.5)
    assert res.pooled.values["recall_all@20"] == pytest.approx(0.25)
    assert res.macro.n == res.pooled.n == 4
    table = format_table(res, "t")
    lines = table.splitlines()
    assert lines[0] == "t"
    assert lines[3].startswith("p1") and lines[-2].startswith("macro") and lines[-1].startswith("pooled")
    assert "0.5000" in lines[-2] and "0.2500" in lines[-1]
    assert "ndcg_any@20" in lines[1]


# ------------------------------------------------------------------------------------------------ replay


class SpyRetriever:
    def __init__(self) -> None:
        self.added: list[Session] = []
        self.calls: list[tuple[Query, list[str]]] = []

    def add_session(self, session: Session) -> None:
        self.added.append(session)

    def retrieve(self, query: Query, k: int) -> list[str]:
        seen = [s.uuid for s in self.added]
        self.calls.append((query, seen))
        return seen[::-1][:k]


def test_replay_never_shows_own_or_later_sessions(persona: Persona) -> None:
    spy = SpyRetriever()
    ticks: list[int] = []
    preds = replay(persona, spy, k=20, progress=ticks.append)
    assert [s.uuid for s in spy.added] == [A, B, C, D, E]
    assert ticks == [1, 2, 3, 4, 5]
    order = {s.uuid: s.position for s in persona.sessions}
    assert [(q.query_id, seen) for q, seen in spy.calls] == [
        ("Q-0001", [A, B]),
        ("Q-0002", [A, B, C]),
        ("Q-0004", [A, B, C, D]),
    ]
    for q, seen in spy.calls:
        assert all(order[u] < q.session_position for u in seen)
        assert q.gold == frozenset()  # the retriever never sees gold
    assert [p.query_id for p in preds] == ["Q-0001", "Q-0002", "Q-0004"]
    res = evaluate([persona], preds)
    assert res.pooled.leaks == 0


def test_recent_baseline_replay_and_evaluate(persona: Persona) -> None:
    preds = replay(persona, RecentRetriever(), k=20)
    assert [p.retrieved for p in preds] == [[B, A], [C, B, A], [D, C, B, A]]
    res = evaluate([persona], preds)
    sc = res.scores["realmem_tiny"]
    # Q-0001: gold A at rank 2 -> ndcg 1 (LongMemEval discount).
    assert sc["Q-0001"].ndcg_any[5] == pytest.approx(1.0)
    # Q-0002: gold {A, C} at ranks 3 and 1 -> (1 + 1/log2 3) / 2.
    assert sc["Q-0002"].recall_all[5] == 1.0
    assert sc["Q-0002"].ndcg_any[5] == pytest.approx((1 + 1 / LOG2_3) / 2)
    # Q-0004: gold {C, E}, E is its own session -> recall_all capped at 0, C at rank 2 -> 1/2.
    assert sc["Q-0004"].recall_all[20] == 0.0 and sc["Q-0004"].recall_any[20] == 1.0
    assert sc["Q-0004"].ndcg_any[5] == pytest.approx(0.5)
    assert res.per_persona["realmem_tiny"].values["recall_all@5"] == pytest.approx(2 / 3)


def test_bm25_baseline_ranks_lexical_match_first(persona: Persona) -> None:
    preds = {p.query_id: p.retrieved for p in replay(persona, SessionBM25Retriever(), k=20)}
    assert preds["Q-0001"][0] == A
    assert preds["Q-0004"][0] == C
    assert set(preds["Q-0002"][:2]) == {A, C}


def test_bm25_idf_and_avgdl_are_online() -> None:
    r = SessionBM25Retriever()
    assert r.scores("apple") == {}
    r.add_session(_session("s1", 0, "banana"))
    r.add_session(_session("s2", 1, "apple banana"))
    one = r.scores("apple")[1]
    r.add_session(_session("s3", 2, "apple cherry cherry cherry"))
    # df(apple) grew from 1 to 2 and avgdl changed, so the same document's score changes.
    assert r.scores("apple")[1] < one
    assert r.retrieve(_query("apple"), 1) == ["s2"]  # shorter doc, same tf
    assert r.retrieve(_query("durian"), 5) == []


def _session(uuid: str, pos: int, text: str) -> Session:
    return Session(uuid, pos, "", (Turn("User", text),))


def _query(text: str) -> Query:
    return Query("p", "q", text, 9, frozenset(), None, "")


def test_evaluate_missing_duplicate_and_unknown_predictions(persona: Persona) -> None:
    res = evaluate([persona], [Prediction("realmem_tiny", "Q-0001", [A])])
    assert res.pooled.missing == 2
    assert res.per_persona["realmem_tiny"].values["recall_all@20"] == pytest.approx(1 / 3)
    # Predictions of other personas are ignored.
    assert evaluate([persona], [Prediction("other", "Q-0001", [A])]).pooled.missing == 3
    with pytest.raises(ValueError):
        evaluate([persona], [Prediction("realmem_tiny", "Q-0001", [A])] * 2)
    with pytest.raises(ValueError):
        evaluate([persona], [Prediction("realmem_tiny", "Q-0003", [A])])


def test_evaluate_flags_leak_of_own_session(persona: Persona) -> None:
    # Q-0004 cites its own session E; returning it is a leak and earns nothing.
    res = evaluate([persona], [Prediction("realmem_tiny", "Q-0004", [E, C])])
    s = res.scores["realmem_tiny"]["Q-0004"]
    assert s.leaks == 1 and s.leaked == (E,)
    assert s.ndcg_any[5] == pytest.approx(0.5)
    assert s.recall_all[20] == 0.0


def test_predictions_jsonl_roundtrip(tmp_path: Path) -> None:
    preds = [Prediction("p", "Q-0001", [A, B]), Prediction("p", "Q-0002", [])]
    text = predictions_to_jsonl(preds)
    assert json.loads(text.splitlines()[0]) == {"persona": "p", "query_id": "Q-0001", "retrieved": [A, B]}
    assert predictions_from_jsonl(text) == preds
    path = tmp_path / "preds.jsonl"
    write_predictions(path, preds)
    assert read_predictions(path) == preds
    with pytest.raises(ValueError):
        predictions_from_jsonl('{"persona": "p", "query_id": "q", "retrieved": "aaaa0001"}')
