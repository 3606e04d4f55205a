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


def memory_controls(state: ev.SessionState) -> MemoryControls:
    """Table 6 rows, applied from the most restrictive condition to the richest one."""
    prefer_recent = bool(state.prefer_recent)
    scope = state.retrieval_scope or ev.LOCAL
    if state.taxonomy.need_memory == 0 or state.lens_recommendation == 0:
        # Self-contained turn: avoid context expansion, keep only the last exchange for conversational flow.
        return MemoryControls(False, 1, 0, scope, prefer_recent)
    if scope == ev.GLOBAL:
        # Cross-session recall: ranked global candidates plus a short recency window.
        recent = 2
        include_active = state.action == ev.MATCH
        retrieve = state.top_k_hint
    else:
        # LOCAL (continuation, local edit, verification): the active thread carries the evidence. A LOCAL
        # topic switch keeps only a short window, since the previous thread's state no longer applies.
        include_active = state.action == ev.MATCH
        recent = 4 if include_active else 2
        retrieve = 0
    if state.top_k_hint == 8:
        # Lens 3 with the largest hint: richer view for synthesis/finalization (retrieval even when LOCAL).
        recent = 4
        retrieve = 8
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


def build_view(
    controls: MemoryControls,
    active_state: str | None,
    recent: Sequence[MemoryRecord],
    retrieved: Sequence[tuple[MemoryRecord, float]],
    policy: str = "mars",
) -> ev.CandidateView:
    """Assemble the ordered candidate view: active state, recent turns (oldest->newest), retrieved history.

    `retrieved` is the retriever's ranking (best first, scored); the controls decide how much of it enters.
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
        scores = [s for _, s in retrieved]
        load.max_retrieval_score = max(scores)
        load.mean_retrieval_score = sum(scores) / len(scores)
    return view


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
