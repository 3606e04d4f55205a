"""State-to-memory policy psi_mem (paper Table 6) and candidate-view construction Select_m (Eq. 12).

The view is built before routing and is model-independent; model-specific clipping happens later in packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mars.domain.text import estimate_tokens
from mars.v1 import events_pb2 as ev

ACTIVE_BLOCK_ID = "active"


@dataclass(frozen=True)
class MemoryControls:
    """m_t = psi_mem(z_t): which blocks enter the candidate view and how much history is retrieved."""

    include_active: bool
    recent_window: int
    retrieve_k: int
    scope: int  # ev.RetrievalScope value
    prefer_recent: bool


#: Recent-turn windows of Table 6: the last exchange ("optional short window" of a self-contained turn),
#: a "short recency window" beside global retrieval, and the recent turns of the active thread ("included").
MINIMAL_WINDOW = 1
SHORT_WINDOW = 2
THREAD_WINDOW = 4
#: The hint that asks for the richest view (Table 6, last row); 8 is the largest allowed top_k_hint.
EXPANDED_TOP_K = 8


def memory_controls(state: ev.SessionState) -> MemoryControls:
    """psi_mem, Table 6 row by row.

    1. need_memory=0 or lens=0: self-contained turn; no active state, the last exchange, no retrieval.
       It gates the other rows, except that top_k_hint=8 (row 6) overrides lens=0 when memory is needed:
       the two fields disagree, and the paper's conservative rule (B.2) keeps memory on. need_memory=0
       always wins, so a self-contained turn is never expanded.
    2. action=MATCH, scope=LOCAL: active state and the thread's recent turns; retrieval stays inside the
       active thread ("none or active-thread artifacts": the store ranks only the thread's records).
    3. phase=REVISE or VERIFY: active state and the thread's recent turns whatever the action says, so a
       revision keeps its artifact even when the controller mis-segments it (not only via the clamp).
    4. scope=GLOBAL: ranked global candidates (top_k_hint of them) beside a short recency window; the
       active summary only when the turn continues the thread (it is optional there).
    5. prefer_recent=1: carried in the controls; the store strengthens the recency prior of the ranking
       ("recent candidates prioritized") and the recent turns are the newest ones by construction.
    6. lens=3 or top_k_hint=8: expanded ranked evidence, i.e. top_k_hint retrieved records in the
       turn's scope on top of what rows 2-5 include (active state and recent turns are kept, not replaced).
    Overlapping rows combine: rows 2-4 decide the active state and the window, rows 2, 4 and 6 the
    retrieval; e.g. a REVISE turn with GLOBAL scope keeps the thread window and ranks global evidence.
    """
    prefer_recent = bool(state.prefer_recent)
    scope = state.retrieval_scope or ev.LOCAL
    top_k = max(0, state.top_k_hint)
    expanded = state.lens_recommendation == 3 or top_k == EXPANDED_TOP_K
    if state.taxonomy.need_memory == 0 or (state.lens_recommendation == 0 and top_k != EXPANDED_TOP_K):
        return MemoryControls(False, MINIMAL_WINDOW, 0, scope, prefer_recent)
    continuing = state.action == ev.MATCH
    revising = state.phase in (ev.REVISE, ev.VERIFY)
    # Rows 2 and 3 keep the active thread; on a topic switch (row 4 aside) the old thread's state and
    # most of its window no longer apply.
    include_active = continuing or revising
    thread_view = revising or (continuing and scope != ev.GLOBAL)
    recent = THREAD_WINDOW if thread_view else SHORT_WINDOW
    # Row 4 ranks global candidates; row 6 expands any memory turn's evidence to the hint; row 2 alone
    # (a lens other than 0 or 3, which the clamp never lets through) retrieves nothing.
    retrieve = top_k if (expanded or scope == ev.GLOBAL) else 0
    return MemoryControls(include_active, recent, retrieve, scope, prefer_recent)


@dataclass(frozen=True)
class MemoryRecord:
    """One stored user/assistant exchange; `seq` orders records of a user oldest -> newest."""

    record_id: str
    session_id: str
    turn_id: str
    seq: int
    user_text: str
    assistant_text: str

    @property
    def text(self) -> str:
        return f"User: {self.user_text}\nAssistant: {self.assistant_text}"


def session_ranking(
    sessions: Sequence[tuple[str, float]],
    records: Sequence[tuple[MemoryRecord, float]],
    exclude_session: str,
    depth: int,
) -> list[ev.RankedSession]:
    """The view's logged ranking: the first `depth` of `sessions` (ranked best first), `exclude_session`
    (the turn's own conversation) left out, each with its best record in `records` (the record ranking,
    when the view ranked records)."""
    best: dict[str, str] = {}
    for record, _ in records:
        best.setdefault(record.session_id, record.record_id)
    return [
        ev.RankedSession(session_id=session, score=score, record_id=best.get(session, ""))
        for session, score in sessions
        if session != exclude_session
    ][: max(0, depth)]


def build_view(
    controls: MemoryControls,
    active_state: str | None,
    recent: Sequence[MemoryRecord],
    retrieved: Sequence[tuple[MemoryRecord, float]],
    policy: str = "mars",
    ranking_bounds: tuple[float, float] | None = None,
) -> ev.CandidateView:
    """Assemble the ordered candidate view: active state, recent turns (oldest->newest), retrieved history.

    `retrieved` is the retriever's ranking (best first, scored); the controls decide how much of it enters.
    `ranking_bounds` is the (lowest, highest) score of the retriever's whole ranking for this query (see
    `score_bounds`); the view's load reports its retrieval scores relative to it (`relative_scores`).
    """
    view = ev.CandidateView(policy=policy)
    if controls.include_active and active_state and active_state.strip():
        view.blocks.append(
            ev.MemoryBlock(
                block_id=ACTIVE_BLOCK_ID,
                kind=ev.ACTIVE_STATE,
                text=active_state,
                score=1.0,
                token_estimate=estimate_tokens(active_state),
            )
        )
    window = list(recent)[-controls.recent_window :] if controls.recent_window > 0 else []
    for rec in window:
        view.blocks.append(_record_block(rec, "recent", ev.RECENT_TURN, 1.0))
    retrieved = list(retrieved)[: max(0, controls.retrieve_k)]
    for rec, score in retrieved:
        view.blocks.append(_record_block(rec, "hist", ev.RETRIEVED_HISTORY, score))

    load = view.load
    load.num_blocks = len(view.blocks)
    load.estimated_tokens = sum(b.token_estimate for b in view.blocks)
    load.num_recent = len(window)
    load.num_retrieved = len(retrieved)
    load.has_retrieved_history = bool(retrieved)
    if retrieved:
        load.max_retrieval_score, load.mean_retrieval_score = relative_scores(
            [s for _, s in retrieved], ranking_bounds
        )
    return view


def score_bounds(ranked: Sequence[tuple[object, float]]) -> tuple[float, float] | None:
    """(lowest, highest) score of a retriever's ranking over the whole memory; None when it is empty."""
    scores = [s for _, s in ranked]
    return (min(scores), max(scores)) if scores else None


def relative_scores(scores: Sequence[float], bounds: tuple[float, float] | None) -> tuple[float, float]:
    """(max, mean) of a view's retrieval scores, min-max normalised into [0, 1] per view.

    Raw scores are not comparable across views: fused reciprocal-rank sums stay below ~0.15 and barely
    move (ranks 1-10 of a k=30 fusion differ by a factor 1.3), BM25 is unbounded, and the scale changes
    with the fusion settings. Relative to the bounds of the retriever's whole ranking for this query, the
    max says how close the view's best retrieved record comes to the best match in the user's memory
    (below 1 when the scope or the recent window kept that match out of the retrieved blocks) and the
    mean how deep into the ranking the retrieved blocks reach. Without bounds the view's own retrieved
    scores are the bounds: the max is then 1 and the mean says how evenly strong the evidence is.
    A zero range (one candidate, or equal scores) counts as full strength.
    """
    if not scores:
        return 0.0, 0.0
    lo, hi = bounds if bounds is not None else (min(scores), max(scores))
    span = hi - lo

    def rel(value: float) -> float:
        return 1.0 if span <= 0 else min(max((value - lo) / span, 0.0), 1.0)

    return rel(max(scores)), rel(sum(scores) / len(scores))


def _record_block(rec: MemoryRecord, prefix: str, kind: int, score: float) -> ev.MemoryBlock:
    text = rec.text
    return ev.MemoryBlock(
        block_id=f"{prefix}:{rec.record_id}",
        kind=kind,  # type: ignore[arg-type]
        text=text,
        score=score,
        token_estimate=estimate_tokens(text),
        source_turn_id=rec.turn_id,
        source_session_id=rec.session_id,
    )
