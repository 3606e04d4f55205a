"""The guarded QTM step (paper Appendix B.1-B.2): whatever the controller does, the turn gets a valid state.

- The controller answers within the deadline: its JSON is parsed and clamped (`clamp_state`), and a
  revision-like continuation it split off as NEW_TOPIC is mapped back to MATCH with memory on.
- It is late or its endpoint fails: the rule-based estimator answers (`fallback_reason` deadline /
  endpoint_error).
- Its output holds no JSON: conservative defaults (continuation, memory on; `fallback_reason`
  parse_error), since guessing from broken output would invent state.
- The turn opens a session after earlier ones: a continuation that needs memory searches beyond the
  session (GLOBAL / CROSS_SESSION), since the session holds no thread yet.

Each outcome is counted (OpenTelemetry counter `mars.qtm.outcomes` and `GuardedEstimator.counts`) and
written on the state's usage, with tokens and the controller cost priced per million tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence

from mars import metrics
from mars.domain.state_rules import clamp_state, detect_cues, estimate_state, widen_session_opening
from mars.llm_json import TokenPrices
from mars.v1 import events_pb2 as ev

from mars_state.qtm.controllers import Controller, ControllerReply, ControllerUnavailable
from mars_state.qtm.schema import ControllerOutputError, parse_controller_output

#: Paper Table 10: the controller (Qwen2.5-7B-Instruct) at $0.04 in and $0.10 out per million tokens.
QTM_PRICES = TokenPrices(0.04, 0.10)


#: Consecutive deadline misses or endpoint errors after which the controller is reported degraded.
UNHEALTHY_AFTER = 3


class GuardedEstimator:
    def __init__(
        self,
        controller: Controller | None,
        deadline_s: float = 2.0,
        pricing: TokenPrices = QTM_PRICES,
    ) -> None:
        self.controller = controller
        self.deadline_s = deadline_s
        self.pricing = pricing
        self.counts: Counter[str] = Counter()
        self._consecutive_failures = 0
        #: Why the configured controller could not be made ("" when it could); the rules answer then.
        self.model_error = ""

    @property
    def backend(self) -> str:
        return self.controller.name if self.controller is not None else "rules"

    @property
    def healthy(self) -> bool:
        """False while the controller keeps failing (turns are then answered by the rules fallback)."""
        return self._consecutive_failures < UNHEALTHY_AFTER

    async def aclose(self) -> None:
        if self.controller is not None:
            await self.controller.aclose()

    def forget_cached(self) -> int:
        """Drop what the controller caches of users' text (the learned backend's embeddings, keyed by
        text): a user was forgotten. Returns the entries dropped."""
        forget = getattr(self.controller, "forget_cached", None)
        return int(forget()) if forget is not None else 0

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        metrics.record_qtm_outcome(outcome, self.backend)

    async def estimate(
        self, text: str, active_context: Sequence[str], opens_session: bool = False
    ) -> ev.SessionState:
        """The turn's state. `opens_session`: the turn is the first of a session after earlier ones (the
        state service knows; `widen_session_opening` then applies, whoever answered)."""
        state = await self._estimate(text, active_context)
        if opens_session and widen_session_opening(state):
            self._count("session_scope")
        return state

    async def _estimate(self, text: str, active_context: Sequence[str]) -> ev.SessionState:
        started = time.perf_counter()
        if self.controller is None:
            state = estimate_state(text, active_context)
            self._count("rules")
            state.usage.latency_ms = (time.perf_counter() - started) * 1000
            return state
        try:
            reply = await asyncio.wait_for(self.controller.call(text, active_context), self.deadline_s)
        except TimeoutError:
            return self._fallback(text, active_context, "deadline", started)
        except ControllerUnavailable:
            return self._fallback(text, active_context, "endpoint_error", started)
        self._consecutive_failures = 0
        state = self._from_reply(reply, text, active_context)
        state.usage.latency_ms = (time.perf_counter() - started) * 1000
        return state

    def _from_reply(
        self, reply: ControllerReply, text: str, active_context: Sequence[str]
    ) -> ev.SessionState:
        try:
            raw = parse_controller_output(reply.text)
        except ControllerOutputError:
            state = clamp_state({})  # conservative defaults: continuation with memory on
            state.usage.fallback_reason = "parse_error"
            self._count("parse_error")
        else:
            state = clamp_state(raw)
            self._count("clamped" if state.clamped_fields else "ok")
            if self._revision_split(state, text, active_context):
                self._count("revision_guard")
        assert self.controller is not None
        state.usage.backend = self.controller.name
        # The learned controller answers without a model call (and without tokens or cost).
        state.usage.llm_called = getattr(self.controller, "calls_llm", True)
        state.usage.prompt_version = self.controller.prompt_version
        state.usage.input_tokens = reply.input_tokens
        state.usage.output_tokens = reply.output_tokens
        state.usage.usage_estimated = reply.usage_estimated
        state.usage.cost_usd = self.pricing.cost(reply.input_tokens, reply.output_tokens)
        return state

    @staticmethod
    def _revision_split(state: ev.SessionState, text: str, active_context: Sequence[str]) -> bool:
        """Paper B.1 note: a revision-like turn with an active thread is a continuation, even when the
        controller called it a new topic; splitting would make the model restart the artifact."""
        if state.action != ev.NEW_TOPIC or not any(c.strip() for c in active_context):
            return False
        if not set(detect_cues(text)) & {"revision", "finalization"}:
            return False
        state.action = ev.MATCH
        state.taxonomy.need_memory = 1
        state.lens_recommendation = 3
        if state.taxonomy.memory_span == ev.NONE:
            state.taxonomy.memory_span = ev.ACTIVE_THREAD
        for name in ("action", "taxonomy.need_memory", "lens_recommendation"):
            if name not in state.clamped_fields:
                state.clamped_fields.append(name)
        return True

    def _fallback(
        self, text: str, active_context: Sequence[str], reason: str, started: float
    ) -> ev.SessionState:
        self._consecutive_failures += 1
        self._count(reason)
        state = estimate_state(text, active_context)
        assert self.controller is not None
        state.usage.fallback_reason = reason
        # The call was made but its answer was not used; its usage is unknown, so no cost is charged.
        state.usage.llm_called = True
        state.usage.prompt_version = self.controller.prompt_version
        state.usage.latency_ms = (time.perf_counter() - started) * 1000
        return state
