"""The state-conditioned candidate view (paper Eq. 12, Table 6): a user's index searched as the turn's state
asks (psi_mem's controls, the view policy's fusion, the learned ranker) and Select_m over the result, with
the session ranking the view logs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

from mars.domain.memory_policy import (
    MemoryControls,
    MemoryRecord,
    build_view,
    memory_controls,
    score_bounds,
    session_ranking,
)
from mars.domain.thread_state import new_thread, render_active_state, thread_from_json
from mars.retrieval.hybrid import POLICY_CONFIGS, HybridConfig, state_conditioned
from mars.retrieval.ranker import LearnedRanker, load_ranker
from mars.telemetry import step
from mars.v1 import events_pb2 as ev

from mars_memory.embedding import MemoryEmbedding
from mars_memory.postgres_store import ThreadRow
from mars_memory.settings import MemorySettings
from mars_memory.user_index import UserIndex

log = logging.getLogger(__name__)


def fusion_config(settings: MemorySettings) -> HybridConfig:
    """The view policy's fusion with MARS_MEMORY_FUSION's overrides (TypeError for a field HybridConfig lacks)."""
    base = POLICY_CONFIGS.get(settings.view_policy, POLICY_CONFIGS["mars"])
    return dataclasses.replace(base, **settings.fusion)  # type: ignore[arg-type]


def memory_ranker(settings: MemorySettings) -> LearnedRanker | None:
    """The learned ranker of the record and session rankings, as MARS_MEMORY_RANKER names it; None (the
    fused ranking) when it is off, the policy is not mars (the ranker learned the mars fusion's signals), or
    the model cannot be used."""
    choice = settings.memory_ranker.strip()
    if choice == "off" or settings.view_policy != "mars":
        return None
    ranker, why = load_ranker(None if choice == "packaged" else Path(choice))
    if ranker is None:
        log.warning("memory ranker unavailable, the fused ranking stays: %s", why)
    else:
        log.info("memory ranker %s", ranker.version)
    return ranker


class CandidateViewBuilder:
    """Builds a turn's view from the user's index (caught up by the caller, its lock held). `config` is the
    policy's fusion; `embedding` embeds the query once for every search of the turn."""

    def __init__(self, settings: MemorySettings, config: HybridConfig, embedding: MemoryEmbedding) -> None:
        self._settings = settings
        self.config = config
        self._embedding = embedding
        self.ranker = memory_ranker(settings)

    def controls(self, state: ev.SessionState) -> MemoryControls:
        if self._settings.view_policy == "mars":
            return memory_controls(state)
        # The ablation policies ignore the state: a fixed budget of retrieved history, nothing else.
        return MemoryControls(False, 0, self._settings.ablation_top_k, ev.GLOBAL, False)

    async def build(
        self,
        index: UserIndex,
        text: str,
        state: ev.SessionState,
        active: ThreadRow | None,
        session_id: str,
    ) -> ev.CandidateView:
        """The view of turn `text` in state `state`; `active` is the user's active thread row, `session_id`
        the turn's session (left out of the logged session ranking)."""
        controls = self.controls(state)
        # A NEW_TOPIC turn starts a fresh thread: the old active thread becomes history.
        continuing = active is not None and state.action != ev.NEW_TOPIC
        thread_id = active[0] if continuing and active else None
        by_seq = sorted(index.records.values(), key=lambda r: r.seq)
        thread = [r for r in by_seq if index.thread_of[r.record_id] == thread_id]
        window = thread[-controls.recent_window :] if controls.recent_window > 0 else []
        active_state = None
        if continuing and active:
            thread_state = thread_from_json(active[2]) if active[2] else new_thread(str(active[1]))
            active_state = render_active_state(thread_state)
        ranked: list[tuple[MemoryRecord, float]] = []
        bounds = None
        if index.records and (controls.retrieve_k > 0 or index.sessions is not None):
            with step("memory embed-query"):  # cached: the searches below reuse it
                await self._embedding.query_vector(text)
        if controls.retrieve_k > 0 and index.records:
            with step("memory search"):
                ranked, bounds = await asyncio.to_thread(self._rank, index, text, thread, controls)
        shown = {r.record_id for r in window}
        # LOCAL scope keeps retrieval inside the active thread (Table 6: local evidence for revisions).
        in_scope = {r.record_id for r in thread} if controls.scope == ev.LOCAL else None
        view = build_view(
            controls,
            active_state,
            window,
            [
                (r, score)
                for r, score in ranked
                if r.record_id not in shown and (in_scope is None or r.record_id in in_scope)
            ],
            policy=self._settings.view_policy,
            ranking_bounds=bounds,
        )
        if index.sessions is not None and index.records:
            with step("memory rank-sessions"):
                sessions = await asyncio.to_thread(self._rank_sessions, index, text, session_id)
            view.ranking.extend(
                session_ranking(sessions, ranked, session_id, self._settings.view_ranking_depth)
            )
        return view

    def _rank_sessions(self, index: UserIndex, text: str, session_id: str) -> list[tuple[str, float]]:
        """The user's other sessions, best first, each ranked over its whole text (the RealMem unit of
        retrieval), with the policy's fusion and the session's recent user turns as context, the state
        aside (what it then lets into the view is the controller's part): the ranking `mars bench
        realmem` computes. The turn's own session is ranked as absent."""
        assert index.sessions is not None
        cfg, context = self.config, []
        if self._settings.view_policy == "mars":
            own = sorted(
                (r for r in index.records.values() if r.session_id == session_id), key=lambda r: r.seq
            )
            context = [r.user_text for r in own[-self._settings.memory_context_turns :]]
        depth = self._settings.view_ranking_depth
        return index.sessions.rank_groups(text, context, depth, cfg, {session_id}, self.ranker)

    def _fusion(self, thread: list[MemoryRecord], controls: MemoryControls) -> tuple[HybridConfig, list[str]]:
        """The fusion settings and secondary query texts of this turn's search."""
        cfg = self.config
        if self._settings.view_policy != "mars":
            return cfg, []
        context = [r.user_text for r in thread[-self._settings.memory_context_turns :]]
        return state_conditioned(cfg, controls.prefer_recent), context

    def _rank(
        self, index: UserIndex, text: str, thread: list[MemoryRecord], controls: MemoryControls
    ) -> tuple[list[tuple[MemoryRecord, float]], tuple[float, float] | None]:
        """Every record of the user, best first, as the view's policy ranks them for this turn (the view
        then keeps those its scope allows), and the score bounds of that ranking."""
        if self._settings.view_policy == "recent":
            newest = sorted(index.records.values(), key=lambda r: -r.seq)
            return [(r, 1.0) for r in newest], None
        cfg, context = self._fusion(thread, controls)
        ranked = index.memory.rank_groups(text, context, len(index.records), cfg, ranker=self.ranker)
        return [(index.records[rid], score) for rid, score in ranked], score_bounds(ranked)
