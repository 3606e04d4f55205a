import pytest
from mars.domain.features import FEATURE_NAMES, featurize
from mars.domain.memory_policy import (
    MemoryControls,
    MemoryRecord,
    build_view,
    memory_controls,
    relative_scores,
    score_bounds,
)
from mars.domain.state_rules import clamp_state
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridMemory
from mars.v1 import events_pb2 as ev


def _state(**over: object) -> ev.SessionState:
    raw: dict[str, object] = {
        "action": "MATCH",
        "query_type": "DYNAMIC",
        "phase": "EXPLORE",
        "taxonomy": {"need_memory": 1, "memory_span": "ACTIVE_THREAD", "ambiguity": "LOW"},
        "lens_recommendation": 3,
        "top_k_hint": 5,
        "prefer_recent": 0,
        "retrieval_scope": "LOCAL",
        "lens_confidence": 0.7,
        "lens_reason": "test",
    }
    raw.update(over)
    return clamp_state(raw)


def _rec(i: int, user: str, assistant: str = "ok", session: str = "s1") -> MemoryRecord:
    return MemoryRecord(f"r{i}", session, f"t{i}", i, user, assistant)


def _raw(**over: object) -> ev.SessionState:
    """A state as a controller could hand it over without the clamp (which rewrites REVISE + NEW_TOPIC)."""
    st = ev.SessionState(
        action=ev.MATCH,
        query_type=ev.DYNAMIC,
        phase=ev.EXPLORE,
        retrieval_scope=ev.LOCAL,
        top_k_hint=5,
        prefer_recent=0,
        lens_recommendation=3,
    )
    st.taxonomy.need_memory = 1
    for key, value in over.items():
        setattr(st, key, value)
    return st


NO_MEMORY = {"need_memory": 0, "memory_span": "NONE", "ambiguity": "LOW"}

# One case per row of paper Table 6 (and the overlaps the docstring of memory_controls resolves):
# (row, state, (include_active, recent_window, retrieve_k, scope)).
TABLE_6 = [
    # Row 1: need_memory=0 or lens=0 -> no active state, the last exchange, no retrieval.
    ("1 need_memory=0", _state(taxonomy=NO_MEMORY), (False, 1, 0, ev.LOCAL)),
    ("1 lens=0", _state(lens_recommendation=0), (False, 1, 0, ev.LOCAL)),
    ("1 need_memory=0 beats top_k=8", _state(taxonomy=NO_MEMORY, top_k_hint=8), (False, 1, 0, ev.LOCAL)),
    (
        "1 need_memory=0, GLOBAL",
        _state(taxonomy=NO_MEMORY, retrieval_scope="GLOBAL"),
        (False, 1, 0, ev.GLOBAL),
    ),
    # Row 2: MATCH + LOCAL -> active state and the thread window; retrieval only from the active thread.
    ("2 MATCH LOCAL", _state(), (True, 4, 5, ev.LOCAL)),
    # Row 3: REVISE / VERIFY -> active state and the thread window even when the action says NEW_TOPIC.
    ("3 REVISE NEW_TOPIC", _raw(phase=ev.REVISE, action=ev.NEW_TOPIC), (True, 4, 5, ev.LOCAL)),
    ("3 VERIFY NEW_TOPIC", _raw(phase=ev.VERIFY, action=ev.NEW_TOPIC), (True, 4, 5, ev.LOCAL)),
    (
        "3 REVISE GLOBAL",
        _raw(phase=ev.REVISE, retrieval_scope=ev.GLOBAL, top_k_hint=3),
        (True, 4, 3, ev.GLOBAL),
    ),
    # Row 4: GLOBAL -> ranked global candidates and a short window; active summary only when continuing.
    ("4 GLOBAL NEW_TOPIC", _state(retrieval_scope="GLOBAL", action="NEW_TOPIC"), (False, 2, 5, ev.GLOBAL)),
    ("4 GLOBAL MATCH", _state(retrieval_scope="GLOBAL", top_k_hint=3), (True, 2, 3, ev.GLOBAL)),
    (
        "4 GLOBAL without lens 3",
        _raw(retrieval_scope=ev.GLOBAL, lens_recommendation=1),
        (True, 2, 5, ev.GLOBAL),
    ),
    # Row 5: prefer_recent=1 -> active state if there is a thread (recency itself: see the test below).
    ("5 prefer_recent MATCH", _state(prefer_recent=1), (True, 4, 5, ev.LOCAL)),
    ("5 prefer_recent GLOBAL", _state(prefer_recent=1, retrieval_scope="GLOBAL"), (True, 2, 5, ev.GLOBAL)),
    # Row 6: lens=3 or top_k=8 -> expanded ranked evidence (the hint) on top of rows 2-5.
    ("6 lens=3, top_k=3", _state(top_k_hint=3), (True, 4, 3, ev.LOCAL)),
    ("6 top_k=8 LOCAL", _state(phase="SYNTHESIZE", top_k_hint=8), (True, 4, 8, ev.LOCAL)),
    ("6 top_k=8 GLOBAL", _state(retrieval_scope="GLOBAL", top_k_hint=8), (True, 2, 8, ev.GLOBAL)),
    ("6 top_k=8 overrides lens=0", _raw(lens_recommendation=0, top_k_hint=8), (True, 4, 8, ev.LOCAL)),
    ("6 neither lens=3 nor top_k=8, LOCAL", _raw(lens_recommendation=1), (True, 4, 0, ev.LOCAL)),
]


@pytest.mark.parametrize(("state", "expected"), [c[1:] for c in TABLE_6], ids=[c[0] for c in TABLE_6])
def test_table_6_rows(state: ev.SessionState, expected: tuple[bool, int, int, int]) -> None:
    c = memory_controls(state)
    assert (c.include_active, c.recent_window, c.retrieve_k, c.scope) == expected


def test_row_5_prefer_recent_reaches_the_ranking() -> None:
    # The store strengthens the recency prior from this flag (hybrid.state_conditioned).
    assert memory_controls(_state(prefer_recent=1)).prefer_recent is True
    assert memory_controls(_state(prefer_recent=0)).prefer_recent is False
    assert memory_controls(_state(prefer_recent=1, taxonomy=NO_MEMORY)).prefer_recent is True


def test_clamped_revision_and_raw_revision_get_the_same_view() -> None:
    # The phase rule, not the clamp's MATCH rewrite, keeps the artifact of a revision.
    clamped = memory_controls(_state(phase="REVISE", action="NEW_TOPIC"))
    raw = memory_controls(_raw(phase=ev.REVISE, action=ev.NEW_TOPIC))
    assert (clamped.include_active, clamped.recent_window) == (raw.include_active, raw.recent_window)


def test_record_text() -> None:
    assert _rec(1, "hi", "hello").text == "User: hi\nAssistant: hello"


def test_build_view_orders_blocks_and_fills_load() -> None:
    recent = [_rec(i, f"recent message {i}") for i in range(10, 16)]
    ranked = [
        (_rec(1, "planning the paris trip budget", "about 2000 euros"), 0.9),
        (_rec(3, "paris hotels near the louvre", "try le marais"), 0.5),
        (_rec(2, "best python testing tools"), 0.1),
    ]
    controls = MemoryControls(True, 4, 2, ev.GLOBAL, False)
    view = build_view(controls, "Active: trip planning", recent, ranked)
    kinds = [b.kind for b in view.blocks]
    assert kinds == [ev.ACTIVE_STATE] + [ev.RECENT_TURN] * 4 + [ev.RETRIEVED_HISTORY] * 2
    assert view.blocks[0].block_id == "active"
    assert [b.block_id for b in view.blocks[1:5]] == ["recent:r12", "recent:r13", "recent:r14", "recent:r15"]
    assert view.blocks[5].block_id == "hist:r1"
    assert view.blocks[5].score >= view.blocks[6].score > 0
    assert view.blocks[5].source_turn_id == "t1" and view.blocks[5].source_session_id == "s1"
    load = view.load
    assert load.num_blocks == 7
    assert load.num_recent == 4
    assert load.num_retrieved == 2 and load.has_retrieved_history
    assert load.estimated_tokens == sum(b.token_estimate for b in view.blocks) > 0
    # Without the ranking's bounds the view's own retrieved scores are the bounds: 0.9 -> 1, 0.5 -> 0.
    assert load.max_retrieval_score == 1.0
    assert load.mean_retrieval_score == pytest.approx(0.5)
    assert view.policy == "mars"


def test_build_view_skips_active_and_retrieval_when_disabled() -> None:
    controls = MemoryControls(False, 1, 0, ev.LOCAL, False)
    recent = [_rec(1, "a"), _rec(2, "b")]
    view = build_view(controls, "Active state", recent, [(_rec(3, "paris"), 1.0)], policy="p")
    assert [b.block_id for b in view.blocks] == ["recent:r2"]
    assert not view.load.has_retrieved_history
    assert view.load.max_retrieval_score == 0.0
    assert view.policy == "p"


def test_retrieved_history_is_capped_by_controls_in_rank_order() -> None:
    ranked = [(_rec(i, f"m{i}"), 1.0 / i) for i in range(1, 9)]
    view = build_view(MemoryControls(False, 0, 3, ev.GLOBAL, False), None, [], ranked)
    assert [b.block_id for b in view.blocks] == ["hist:r1", "hist:r2", "hist:r3"]
    assert view.load.num_retrieved == 3


def test_relative_scores_against_the_ranking_bounds() -> None:
    # Bounds of the whole ranking: the view's best record is not the best match (scope kept it out).
    assert relative_scores([0.10, 0.08], (0.06, 0.14)) == pytest.approx((0.5, 0.375))
    assert relative_scores([0.14], (0.06, 0.14)) == (1.0, 1.0)
    # Outside the bounds (a caller's mistake) is clipped, a zero range counts as full strength.
    assert relative_scores([0.2, 0.0], (0.06, 0.14)) == (1.0, pytest.approx(0.5))
    assert relative_scores([0.1, 0.1], None) == (1.0, 1.0)
    assert relative_scores([], None) == (0.0, 0.0)


def test_score_bounds() -> None:
    assert score_bounds([("a", 0.12), ("b", 0.03), ("c", 0.07)]) == (0.03, 0.12)
    assert score_bounds([]) is None


def _score_features(view: ev.CandidateView) -> tuple[float, float]:
    f = dict(zip(FEATURE_NAMES, featurize(ev.SessionState(), view.load, 1).tolist(), strict=True))
    return f["load.max_retrieval_score"], f["load.mean_retrieval_score"]


def test_rrf_views_spread_the_score_features() -> None:
    """Real fused rankings (BM25 + recency + reciprocal-rank fusion of the mars policy): raw sums stay
    below ~0.15, so a squash s/(1+s) kept both features under 0.13; relative to each query's ranking they
    spread over [0, 1]."""
    topics = ["paris trip budget", "python testing tools", "sourdough bread recipe", "marathon training plan"]
    records = [_rec(i, f"{topics[i % 4]} note {i}", f"details on {topics[i % 4]}") for i in range(12)]
    memory = HybridMemory(None, POLICY_CONFIGS["mars"])
    for r in records:
        memory.add_group(r.record_id, r.seq, [r.text])
    by_id = {r.record_id: r for r in records}
    maxes, means = [], []
    for query in ["how much was the paris budget", "which testing tools", "bread", "weekly training"]:
        ranked = memory.rank_groups(query, [], len(records))
        assert ranked[0][1] < 0.15
        # Retrieval skips records the recent window already shows, as the store does.
        shown = {rid for rid, _ in ranked[:2]} if query == "bread" else set()
        hits = [(by_id[rid], s) for rid, s in ranked if rid not in shown]
        controls = MemoryControls(False, 0, 5, ev.GLOBAL, False)
        view = build_view(controls, None, [], hits, ranking_bounds=score_bounds(ranked))
        mx, mean = _score_features(view)
        maxes.append(mx)
        means.append(mean)
    assert max(maxes) == 1.0 and min(maxes) < 1.0  # the shown top matches lower the "bread" view's max
    assert max(means) - min(means) > 0.1 and 0.2 < min(means) < max(means) < 1.0
