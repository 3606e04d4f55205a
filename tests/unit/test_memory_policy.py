import pytest
from mars.domain.memory_policy import MemoryControls, MemoryRecord, build_view, memory_controls
from mars.domain.state_rules import clamp_state
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


def test_no_memory_need_gives_minimal_view() -> None:
    c = memory_controls(_state(taxonomy={"need_memory": 0, "memory_span": "NONE", "ambiguity": "LOW"}))
    assert (c.include_active, c.recent_window, c.retrieve_k) == (False, 1, 0)
    c = memory_controls(_state(lens_recommendation=0))
    assert (c.include_active, c.recent_window, c.retrieve_k) == (False, 1, 0)


def test_match_local_keeps_thread_without_retrieval() -> None:
    c = memory_controls(_state(phase="REVISE", prefer_recent=1))
    assert c == MemoryControls(True, 4, 0, ev.LOCAL, True)


def test_global_retrieves_top_k_hint() -> None:
    c = memory_controls(_state(retrieval_scope="GLOBAL", action="NEW_TOPIC", top_k_hint=5))
    assert (c.include_active, c.recent_window, c.retrieve_k, c.scope) == (False, 2, 5, ev.GLOBAL)
    c = memory_controls(_state(retrieval_scope="GLOBAL", top_k_hint=3))
    assert (c.include_active, c.recent_window, c.retrieve_k) == (True, 2, 3)


def test_top_k_8_expands_view() -> None:
    c = memory_controls(_state(phase="SYNTHESIZE", top_k_hint=8))
    assert (c.include_active, c.recent_window, c.retrieve_k) == (True, 4, 8)
    c = memory_controls(_state(retrieval_scope="GLOBAL", top_k_hint=8))
    assert (c.recent_window, c.retrieve_k) == (4, 8)


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
    assert load.max_retrieval_score == pytest.approx(view.blocks[5].score)
    assert load.mean_retrieval_score == pytest.approx((view.blocks[5].score + view.blocks[6].score) / 2)
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
