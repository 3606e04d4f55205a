import pytest
from mars.domain.packing import MESSAGE_OVERHEAD_TOKENS, input_budget, memory_guidance, pack_view
from mars.domain.state_rules import clamp_state
from mars.domain.text import estimate_tokens
from mars.v1 import events_pb2 as ev

STATE = clamp_state(
    {
        "action": "MATCH",
        "query_type": "DYNAMIC",
        "phase": "REVISE",
        "taxonomy": {"need_memory": 1, "memory_span": "ACTIVE_THREAD", "ambiguity": "LOW"},
        "lens_recommendation": 3,
        "top_k_hint": 5,
        "prefer_recent": 1,
        "retrieval_scope": "LOCAL",
        "lens_confidence": 0.8123,
        "lens_reason": "Revision of the active artifact.",
    }
)
QUERY = "Make the intro shorter"


def _block(bid: str, kind: int, score: float, size: int = 400) -> ev.MemoryBlock:
    text = f"{bid} " + "x" * size
    return ev.MemoryBlock(
        block_id=bid,
        kind=kind,
        text=text,
        score=score,  # type: ignore[arg-type]
        token_estimate=estimate_tokens(text),
    )


def _view() -> ev.CandidateView:
    return ev.CandidateView(
        blocks=[
            _block("active", ev.ACTIVE_STATE, 1.0),
            _block("recent:r1", ev.RECENT_TURN, 1.0),
            _block("recent:r2", ev.RECENT_TURN, 1.0),
            _block("hist:h1", ev.RETRIEVED_HISTORY, 5.0),
            _block("hist:h2", ev.RETRIEVED_HISTORY, 2.0),
            _block("hist:h3", ev.RETRIEVED_HISTORY, 3.0),
        ]
    )


def test_input_budget() -> None:
    assert input_budget(8192, 1024, 256) == 6912
    with pytest.raises(ValueError):
        input_budget(1000, 900, 100)
    with pytest.raises(ValueError):
        input_budget(1000, 2000, 0)


def test_everything_fits_under_large_budget() -> None:
    p = pack_view(_view(), QUERY, STATE, 100_000)
    assert p.fits and p.clipped_block_ids == []
    assert [b.block_id for b in p.blocks] == [b.block_id for b in _view().blocks]
    assert [m["role"] for m in p.messages] == ["system", "user"]
    assert p.messages[1]["content"] == QUERY
    system = p.messages[0]["content"]
    order = [system.index(s) for s in ("SYSTEM RULES", "MEMORY GUIDANCE", "\nMEMORY\n")]
    assert order == sorted(order)
    assert "REVISE" in system and "continuation" in system
    assert "0.8123" not in system  # no internal controller scores
    # Counted piece by piece (header, blocks, separators, query): with the conservative estimate that
    # never falls below counting the joined prompt, and stays within a token or two per piece of it.
    whole = sum(estimate_tokens(m["content"]) + MESSAGE_OVERHEAD_TOKENS for m in p.messages)
    assert whole <= p.prompt_tokens <= whole + 2 * (len(p.blocks) + 3)


def _clip_sequence() -> list[str]:
    full = pack_view(_view(), QUERY, STATE, 100_000).prompt_tokens
    step = estimate_tokens("x" * 400)
    seqs = []
    for n in range(1, 6):
        p = pack_view(_view(), QUERY, STATE, full - n * step + 10)
        assert p.fits and p.prompt_tokens <= full - n * step + 10
        seqs.append(p.clipped_block_ids)
    for n, seq in enumerate(seqs, start=1):
        assert len(seq) == n and seq == seqs[-1][:n]  # each tighter budget clips one more, same order
    return seqs[-1]


def test_clip_order_history_by_score_then_recent_oldest_first() -> None:
    assert _clip_sequence() == ["hist:h2", "hist:h3", "hist:h1", "recent:r1", "recent:r2"]


def test_budget_respected_with_minimal_clipping() -> None:
    full = pack_view(_view(), QUERY, STATE, 100_000).prompt_tokens
    p = pack_view(_view(), QUERY, STATE, full - 50)
    assert p.fits and p.prompt_tokens <= full - 50
    assert p.clipped_block_ids == ["hist:h2"]
    assert "hist:h2" not in p.messages[0]["content"]
    assert "hist:h1" in p.messages[0]["content"]


def test_active_state_and_query_never_dropped() -> None:
    p = pack_view(_view(), QUERY, STATE, 10)
    assert not p.fits
    assert [b.block_id for b in p.blocks] == ["active"]
    assert len(p.clipped_block_ids) == 5
    assert "active " in p.messages[0]["content"]
    assert p.messages[1]["content"] == QUERY
    assert p.prompt_tokens > 10


def test_custom_token_counter_is_used() -> None:
    p = pack_view(_view(), QUERY, STATE, 10**6, count_tokens=lambda s: 1)
    n = len(_view().blocks)
    # header + each block + the separators between blocks + query, plus two message overheads.
    assert p.prompt_tokens == 1 + n + (n - 1) + 1 + 2 * MESSAGE_OVERHEAD_TOKENS


def test_packer_never_exceeds_any_budget_on_random_views() -> None:
    """Property test over random views and budgets: within budget when it fits, active state and query kept."""
    import random

    from mars.domain.text import estimate_tokens as count

    rnd = random.Random(42)
    words = "alpha beta gamma delta trip budget poem revise draft table chart memory".split()
    for _ in range(500):
        view = ev.CandidateView()
        if rnd.random() < 0.7:
            view.blocks.append(
                ev.MemoryBlock(
                    block_id="active",
                    kind=ev.ACTIVE_STATE,
                    text=" ".join(rnd.choices(words, k=rnd.randint(5, 80))),
                )
            )
        for i in range(rnd.randint(0, 6)):
            view.blocks.append(
                ev.MemoryBlock(
                    block_id=f"recent:{i}",
                    kind=ev.RECENT_TURN,
                    text=" ".join(rnd.choices(words, k=rnd.randint(5, 300))),
                )
            )
        for i in range(rnd.randint(0, 8)):
            view.blocks.append(
                ev.MemoryBlock(
                    block_id=f"hist:{i}",
                    kind=ev.RETRIEVED_HISTORY,
                    text=" ".join(rnd.choices(words, k=rnd.randint(5, 400))),
                    score=rnd.random(),
                )
            )
        for b in view.blocks:
            b.token_estimate = count(b.text)
        query = " ".join(rnd.choices(words, k=rnd.randint(1, 60)))
        budget = rnd.randint(50, 4000)
        packed = pack_view(view, query, ev.SessionState(phase=ev.REVISE), budget)
        kept = {b.block_id for b in packed.blocks}
        if packed.fits:
            assert packed.prompt_tokens <= budget
        assert all(b.block_id in kept for b in view.blocks if b.kind == ev.ACTIVE_STATE)
        assert packed.messages[-1]["content"] == query
        assert kept | set(packed.clipped_block_ids) == {b.block_id for b in view.blocks}


def test_without_state_header_the_prompt_has_rules_memory_and_query_only() -> None:
    """The no-state-header ablation: MEMORY GUIDANCE is gone, the memory blocks and clipping are not."""
    with_header = pack_view(_view(), QUERY, STATE, 100_000)
    p = pack_view(_view(), QUERY, STATE, 100_000, state_header=False)
    system = p.messages[0]["content"]
    assert system.startswith("SYSTEM RULES") and "\nMEMORY\n" in system
    assert "MEMORY GUIDANCE" not in system and "REVISE" not in system and "continuation" not in system
    assert system == with_header.messages[0]["content"].replace(memory_guidance(STATE) + "\n\n", "")
    assert p.messages[1]["content"] == QUERY
    assert [b.block_id for b in p.blocks] == [b.block_id for b in with_header.blocks]
    saved = with_header.prompt_tokens - p.prompt_tokens
    assert abs(saved - estimate_tokens(memory_guidance(STATE) + "\n\n")) <= 2  # the header's own tokens
    whole = sum(estimate_tokens(m["content"]) + MESSAGE_OVERHEAD_TOKENS for m in p.messages)
    assert whole <= p.prompt_tokens <= whole + 2 * (len(p.blocks) + 3)
    # The header's tokens go to memory instead: a budget that clips a block with it keeps it without.
    tight = with_header.prompt_tokens - 50
    assert pack_view(_view(), QUERY, STATE, tight).clipped_block_ids == ["hist:h2"]
    assert pack_view(_view(), QUERY, STATE, tight, state_header=False).clipped_block_ids == []


def test_memory_budget_clips_the_memory_in_drop_order() -> None:
    """A turn's view_tokens caps the memory blocks alone: lowest-scored history goes first, and no
    remaining block set exceeds the cap; active state and query stay."""
    full = pack_view(_view(), QUERY, STATE, 100_000)
    block_tokens = estimate_tokens("[Retrieved history]\nhist:h1 " + "x" * 400)
    capped = pack_view(_view(), QUERY, STATE, 100_000, memory_budget=4 * block_tokens)
    assert capped.fits and capped.prompt_tokens < full.prompt_tokens
    assert capped.clipped_block_ids[:2] == ["hist:h2", "hist:h3"]
    assert "active" in [b.block_id for b in capped.blocks]
    assert capped.messages[-1]["content"] == QUERY
    tiny = pack_view(_view(), QUERY, STATE, 100_000, memory_budget=1)
    assert [b.block_id for b in tiny.blocks] == ["active"]
    assert tiny.fits
