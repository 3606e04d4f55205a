"""Recorded history import, the pure part (mars_ingress.history): stable turn ids, thread starts, the state an
imported pair is stored under, and the checks a request passes before anything is written."""

from __future__ import annotations

from collections import Counter

import pytest
from fresh_process import across_processes
from mars.domain.memory_policy import MemoryRecord, session_ranking
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars_ingress import history


def turn(session: str, user: str, answer: str = "ok", key: str = "") -> svc.RecordedTurn:
    return svc.RecordedTurn(session_id=session, user_text=user, assistant_text=answer, key=key)


def test_keys_are_stable_and_a_repeated_exchange_stays_two_pairs() -> None:
    turns = [turn("a", "hi"), turn("a", "hi"), turn("b", "hi"), turn("a", "x", key="mine")]
    keys = history.pair_keys(turns)
    # The same call made again, as a retry that another ingress replica serves: the same keys and turn ids,
    # also in processes whose string hashes differ (PYTHONHASHSEED).
    code = (
        "import json; from mars_ingress import history; from mars.v1 import services_pb2 as svc; "
        "turns = [svc.RecordedTurn(session_id=s, user_text=u, assistant_text='ok', key=k) "
        "for s, u, k in (('a', 'hi', ''), ('a', 'hi', ''), ('b', 'hi', ''), ('a', 'x', 'mine'))]; "
        "keys = history.pair_keys(turns); "
        "print(json.dumps([keys, [history.imported_turn_id('t', 'u', k) for k in keys]]))"
    )
    first, second = across_processes(code)
    assert first == second == [keys, [history.imported_turn_id("t", "u", k) for k in keys]]
    assert len(set(keys)) == 4 and keys[3] == "mine"
    assert keys[0] != keys[1]  # the same pair twice is two pairs
    assert keys[0] != keys[2]  # the same words in another session are another pair
    # Turn ids: the same key of another user, or another tenant, is another turn.
    ids = {history.imported_turn_id(t, u, "k") for t, u in (("t", "u"), ("t", "v"), ("s", "u"))}
    assert len(ids) == 3
    assert all(i.startswith("imp") and len(i) == 32 for i in ids)


def test_threads_start_at_the_first_pair_and_at_each_change_of_session() -> None:
    pairs = history.check_history(
        "t", "u", [turn("a", "1"), turn("a", "2"), turn("b", "3"), turn("a", "4"), turn("a", "5")], 100
    )
    assert [p.new_thread for p in pairs] == [True, False, True, True, False]
    assert history.thread_depths(pairs) == [1, 2, 1, 1, 2]
    assert history.last_thread_context(pairs) == (["4", "5"], 2)
    states = [history.imported_state(p, d) for p, d in zip(pairs, history.thread_depths(pairs), strict=True)]
    assert [s.action for s in states] == [ev.NEW_TOPIC, ev.MATCH, ev.NEW_TOPIC, ev.NEW_TOPIC, ev.MATCH]
    assert {s.usage.backend for s in states} == {history.IMPORTED_BACKEND}
    assert not any(s.usage.llm_called or s.usage.cost_usd for s in states)
    # An empty session id is the default session, as for SendTurn; an unanswered user turn is kept.
    (only,) = history.check_history("t", "u", [svc.RecordedTurn(user_text="no reply")], 100)
    assert only.session_id == "default" and only.assistant_text == ""


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        ([], "turns is empty"),
        ([turn("a", "  ")], "turns[0].user_text is empty"),
        ([turn("a", "x" * 41)], "turns[0].user_text has 41 characters; the limit is 40"),
        (
            [turn("a", "ok"), turn("a", "ok", "y" * 41)],
            "turns[1].assistant_text has 41 characters; the limit is 40",
        ),
        ([turn("a", "bell\x07")], "turns[0].user_text contains the control character U+0007 at position 4"),
        ([turn("bad session", "x")], "turns[0].session_id must match"),
        ([turn("a", "x", key="k"), turn("a", "y", key="k")], "turns[1].key 'k' repeats turns[0].key"),
        ([turn("a", "x", key="k\x00")], "turns[0].key must be 1..200 printable characters"),
    ],
)
def test_a_bad_pair_is_named_and_nothing_is_imported(turns: list[svc.RecordedTurn], message: str) -> None:
    with pytest.raises(history.InvalidHistory) as info:
        history.check_history("t", "u", turns, 10)
    assert message in str(info.value)


def test_too_many_pairs_in_one_call_are_refused() -> None:
    turns = [turn("a", f"t{i}") for i in range(history.MAX_TURNS_PER_CALL + 1)]
    with pytest.raises(history.InvalidHistory, match="send the rest in later calls"):
        history.check_history("t", "u", turns, 10)


def record(rid: str, session: str) -> MemoryRecord:
    return MemoryRecord(rid, session, f"turn-{rid}", 1, "u", "a")


def test_session_ranking_leaves_out_the_own_session_and_names_each_sessions_best_record() -> None:
    sessions = [("own", 0.9), ("s1", 0.8), ("s2", 0.6), ("s3", 0.5)]
    records = [(record("r1", "own"), 0.9), (record("r3", "s1"), 0.8), (record("r2", "s1"), 0.7)]
    ranking = session_ranking(sessions, records, "own", 2)
    assert [(r.session_id, r.record_id, r.score) for r in ranking] == [("s1", "r3", 0.8), ("s2", "", 0.6)]
    assert [r.session_id for r in session_ranking(sessions, [], "", 10)] == ["own", "s1", "s2", "s3"]
    assert session_ranking(sessions, records, "own", 0) == []


def test_a_session_opening_continuation_searches_beyond_the_session() -> None:
    import asyncio

    from mars.domain.state_rules import widen_session_opening
    from mars_state.qtm.guard import GuardedEstimator

    local = ev.SessionState(action=ev.MATCH, retrieval_scope=ev.LOCAL)
    local.taxonomy.need_memory = 1
    local.taxonomy.memory_span = ev.ACTIVE_THREAD
    assert widen_session_opening(local)
    assert (local.retrieval_scope, local.taxonomy.memory_span) == (ev.GLOBAL, ev.CROSS_SESSION)
    assert {"retrieval_scope", "taxonomy.memory_span"} <= set(local.clamped_fields)
    assert not widen_session_opening(local)  # already global
    for unchanged in (
        ev.SessionState(action=ev.NEW_TOPIC, retrieval_scope=ev.LOCAL),  # a new topic
        ev.SessionState(action=ev.MATCH, retrieval_scope=ev.LOCAL),  # no memory needed
    ):
        assert not widen_session_opening(unchanged) and unchanged.retrieval_scope == ev.LOCAL
    # Through the guard (the rules here): only a turn that opens a session is widened.
    guard = GuardedEstimator(None)
    text, context = "Make it shorter please", ["Draft a cover letter for the analyst job"]
    inside = asyncio.run(guard.estimate(text, context))
    opening = asyncio.run(guard.estimate(text, context, opens_session=True))
    assert inside.action == ev.MATCH and inside.taxonomy.need_memory == 1
    assert inside.retrieval_scope == ev.LOCAL and opening.retrieval_scope == ev.GLOBAL
    assert guard.counts["session_scope"] == 1


def test_history_file_lines_are_read_or_refused_with_their_line_number() -> None:
    from mars_tools.history_cli import RecordedFileError, read_recorded

    lines = [
        '{"session_id": "a", "user_text": "hi", "assistant_text": "hello"}',
        "",
        '{"user_text": "no reply", "key": "k1"}',
    ]
    turns = read_recorded(lines)
    assert [(t.session_id, t.user_text, t.assistant_text, t.key) for t in turns] == [
        ("a", "hi", "hello", ""),
        ("", "no reply", "", "k1"),
    ]
    for bad, message in (
        ("{nope", "line 1: not JSON"),
        ('{"text": "x"}', 'line 1: expected an object with a "user_text" string'),
        ('{"user_text": "x", "speaker": "me"}', "line 1: unknown field(s) speaker"),
        (
            '{"user_text": "x", "key": 3}',
            "line 1: session_id, user_text, assistant_text, key must be strings",
        ),
    ):
        with pytest.raises(RecordedFileError) as info:
            read_recorded([bad])
        assert message in str(info.value)


def test_a_turns_history_skips_what_mars_holds_by_user_text_in_the_session() -> None:
    """TurnRequest.history: held turns (counted by text digest) are skipped, a repeated text is skipped only
    as often as it is held, and each unheld pair is put in the turn's session."""
    sent = [turn("", "plan a trip", "sure"), turn("", "yes", "ok"), turn("", "yes", "done"), turn("", "new")]
    digest = history.text_digest("t", "u", "s1", "yes")
    assert digest != history.text_digest("t", "u", "s2", "yes") != history.text_digest("t", "v", "s1", "yes")
    held = Counter({history.text_digest("t", "u", "s1", "plan a trip"): 1, digest: 1})
    digests = [history.text_digest("t", "u", "s1", t.user_text) for t in sent]
    left = history.unheld_turns("s1", sent, digests, held)
    assert [(t.session_id, t.user_text, t.assistant_text) for t in left] == [
        ("s1", "yes", "done"),
        ("s1", "new", "ok"),
    ]
    assert history.unheld_turns("s1", sent, digests, Counter()) == [
        svc.RecordedTurn(session_id="s1", user_text=t.user_text, assistant_text=t.assistant_text)
        for t in sent
    ]


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        ([turn("", "")], r"history\[0\].user_text is empty"),
        ([turn("", "a"), turn("other", "b")], r"history\[1\].session_id differs from the turn's"),
        ([turn("", "a", key="k")], r"history\[0\].key is not used here"),
        ([turn("", "a", "x" * 401)], r"history\[0\].assistant_text has 401 characters; the limit is 400"),
        ([turn("", "a\x00")], r"history\[0\].user_text contains the control character U\+0000"),
    ],
)
def test_a_turns_history_is_checked_before_anything_is_written(
    turns: list[svc.RecordedTurn], message: str
) -> None:
    with pytest.raises(history.InvalidHistory, match=message):
        history.check_turn_history(turns, "s1", 100)
    history.check_turn_history([turn("s1", "fine", "yes"), turn("", "also")], "s1", 100)
