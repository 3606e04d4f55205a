"""Generation dispatch, step by step: pack the candidate view for an arm's own budget (Eq. 13), call the arm
through its circuit breaker, fall back to the next arm with a fresh packing, and build the Generated event
(answer, usage, generator cost, what was packed, one GenerationAttempt per arm tried)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from mars import metrics
from mars.domain.circuit import CircuitBreaker
from mars.domain.packing import PackedPrompt, input_budget, pack_view
from mars.model_pool import ModelPool, ModelSpec
from mars.telemetry import step
from mars.tokens import load_counter
from mars.v1 import events_pb2 as ev

from mars_dispatch.clients import Completion, DeadlineExceeded, GenerationError, ModelClients

log = logging.getLogger(__name__)

#: on_delta(arm, piece, restart): one streamed piece of an arm's answer.
DeltaSink = Callable[[str, str, bool], Awaitable[None]]


class DispatchConfig(Protocol):
    """What the dispatcher reads from the service settings (DispatchSettings has these fields)."""

    @property
    def state_header(self) -> bool: ...

    @property
    def circuit_failure_threshold(self) -> int: ...

    @property
    def circuit_reset_s(self) -> float: ...


class _StreamRelay:
    """Forwards streamed pieces to the caller and marks `restart` on the first piece of a fallback arm
    after another arm streamed part of an answer and failed."""

    def __init__(self, on_delta: DeltaSink) -> None:
        self._on_delta = on_delta
        self._streamed_any = False

    def for_arm(self, arm: str) -> Callable[[str], Awaitable[None]]:
        first = True

        async def forward(piece: str) -> None:
            nonlocal first
            await self._on_delta(arm, piece, first and self._streamed_any)
            first, self._streamed_any = False, True

        return forward


class Dispatcher:
    def __init__(self, pool: ModelPool, clients: ModelClients, settings: DispatchConfig) -> None:
        self._pool = pool
        self._clients = clients
        self._state_header = settings.state_header
        self.breakers = {
            m.name: CircuitBreaker(settings.circuit_failure_threshold, settings.circuit_reset_s)
            for m in pool.models
        }
        metrics.watch_circuits(self)  # mars.circuit.state per arm

    async def generate(
        self,
        arms: list[str],
        text: str,
        state: ev.SessionState,
        view: ev.CandidateView,
        max_tokens: int,
        cascade_min_logprob: float = 0.0,
        on_delta: DeltaSink | None = None,
        deadline_ms: int = 0,
        view_tokens: int | None = None,
    ) -> ev.Generated:
        """Try each arm in order; each attempt packs the view for that arm's own budget.

        With a cascade threshold (< 0), an answer whose mean token log-probability is below it is kept
        only as a provisional answer and the next arm is asked; every call's cost is counted.
        With `on_delta(arm, text, restart)` the answer is streamed (not with the cascade, which needs the
        whole answer's log-probabilities first); `restart` marks the first piece of a fallback arm after
        another arm streamed part of an answer and failed. `deadline_ms` (epoch ms, 0 = none) is the
        turn's deadline: no call outlives it, and a call it cuts is not held against the arm. `view_tokens`
        (the turn's option) caps the tokens of the memory blocks packed for any arm."""
        out = ev.Generated(status=ev.FAILED, query=text, state=state)
        started = time.perf_counter()
        relay = _StreamRelay(on_delta) if on_delta is not None and cascade_min_logprob >= 0 else None
        for arm in arms:
            spec = self._pool.get(arm)
            with step("dispatch pack"):
                packed = self._pack(spec, text, state, view, view_tokens)
            # The attempt's latency is the model call alone (load harnesses subtract it as model time).
            t0 = time.perf_counter()
            attempt = ev.GenerationAttempt(
                arm=arm,
                packed_prompt_tokens=packed.prompt_tokens,
                packed_blocks=len(packed.blocks),
                clipped_blocks=len(packed.clipped_block_ids),
            )
            with step("dispatch model-call"):
                completion, outcome = await self._try_arm(
                    spec, packed, max_tokens, cascade_min_logprob < 0, relay, deadline_ms, attempt
                )
            if completion is not None:
                self._record_answer(out, attempt, spec, packed, completion)
                attempt.escalated = arm != arms[-1] and _below_cascade(completion, cascade_min_logprob)
            attempt.latency_ms = (time.perf_counter() - t0) * 1000
            attempt.outcome = "escalated" if attempt.escalated else outcome
            metrics.record_dispatch_attempt(arm, attempt.outcome)
            out.attempts.append(attempt)
            if attempt.ok and not attempt.escalated:
                break
            if attempt.escalated:
                log.info("arm %s answered with mean logprob %.3f: escalating", arm, attempt.mean_logprob)
            else:
                log.warning("arm %s failed: %s", arm, attempt.error)
        if out.status != ev.OK:
            out.error = "all arms failed"
        out.latency_ms = (time.perf_counter() - started) * 1000
        return out

    def _pack(
        self,
        spec: ModelSpec,
        text: str,
        state: ev.SessionState,
        view: ev.CandidateView,
        view_tokens: int | None = None,
    ) -> PackedPrompt:
        """Eq. 13 for this arm: its own input budget and token counter; `view_tokens` caps the memory."""
        return pack_view(
            view,
            text,
            state,
            input_budget(spec.context_window, spec.output_reserve, spec.safety_margin),
            load_counter(spec.tokenizer),
            state_header=self._state_header,
            memory_budget=view_tokens,
        )

    async def _try_arm(
        self,
        spec: ModelSpec,
        packed: PackedPrompt,
        max_tokens: int,
        want_logprobs: bool,
        relay: _StreamRelay | None,
        deadline_ms: int,
        attempt: ev.GenerationAttempt,
    ) -> tuple[Completion | None, str]:
        """The arm's completion, or None with `attempt.error` saying why there is none, and the attempt's
        outcome (mars.metrics.DISPATCH_OUTCOMES). The circuit gets a verdict on every call it let through
        (a half-open trial is always resolved), but only the endpoint's own failures count against it: not
        the turn's deadline, not a cancelled caller."""
        arm = spec.name
        breaker = self.breakers[arm]
        # The caller's deadline bounds every call: nobody waits for an answer after it.
        remaining_s = (deadline_ms - time.time() * 1000) / 1000 if deadline_ms else None
        if not packed.fits:
            attempt.error = f"query and active state exceed the input budget of {arm}"
            return None, "no_fit"
        if remaining_s is not None and remaining_s <= 0:
            attempt.error = f"the turn's deadline passed before {arm} was called"
            return None, "deadline_passed"
        if not breaker.allow():
            attempt.error = (
                f"circuit open for {arm}: {breaker.failure_threshold} failed calls in a row; "
                f"a trial call goes through {breaker.reset_after_s:g}s after the last failure"
            )
            return None, "circuit_open"
        verdict: bool | None = None  # True: the endpoint answered; False: it failed; None: no verdict
        outcome = "error"
        try:
            completion = await self._call(spec, packed, max_tokens, want_logprobs, relay, remaining_s)
            verdict = True
            return completion, "ok"
        except GenerationError as exc:
            verdict = False
            outcome = "endpoint_error"
            attempt.error = str(exc)
            if exc.body:
                log.info("arm %s answered %s: %r", arm, exc, exc.body)
        except DeadlineExceeded as exc:
            # Cut by the turn's own deadline: one caller's short deadline must not open the arm's circuit
            # for every tenant. It counts only if the endpoint had already failed an attempt of this call.
            verdict = False if exc.endpoint_error is not None else None
            outcome = "deadline"
            attempt.error = f"{arm} did not finish before the turn's deadline" + (
                f" (after {exc.endpoint_error})" if exc.endpoint_error is not None else ""
            )
        except Exception as exc:  # a defect on our side, not the endpoint's: fall back, count nothing
            log.exception("unexpected error calling %s", arm)
            attempt.error = f"unexpected {type(exc).__name__} calling {arm}: {exc}"
        finally:
            # Also on cancellation (BaseException): a trial left unresolved would keep the circuit from
            # ever closing again.
            if verdict is True:
                breaker.record_success()
            elif verdict is False:
                breaker.record_failure()
            else:
                breaker.release()
        return None, outcome

    async def _call(
        self,
        spec: ModelSpec,
        packed: PackedPrompt,
        max_tokens: int,
        want_logprobs: bool,
        relay: _StreamRelay | None,
        remaining_s: float | None,
    ) -> Completion:
        limit = min(max_tokens, spec.output_reserve)
        if relay is not None:
            return await self._clients.stream(spec, packed, limit, relay.for_arm(spec.name), remaining_s)
        return await self._clients.complete(
            spec, packed, limit, want_logprobs=want_logprobs, timeout_s=remaining_s
        )

    @staticmethod
    def _record_answer(
        out: ev.Generated,
        attempt: ev.GenerationAttempt,
        spec: ModelSpec,
        packed: PackedPrompt,
        completion: Completion,
    ) -> None:
        """The arm's answer becomes the turn's (a later cascade arm may replace it); its cost adds up."""
        attempt.ok = True
        if completion.mean_logprob is not None:
            attempt.mean_logprob = completion.mean_logprob
            attempt.has_logprob = True
        out.status = ev.OK
        out.model = spec.name
        out.text = completion.text
        out.usage.CopyFrom(
            ev.Usage(
                input_tokens=completion.input_tokens,
                output_tokens=completion.output_tokens,
                estimated=completion.usage_estimated,
            )
        )
        out.cost_usd += spec.cost_usd(completion.input_tokens, completion.output_tokens)
        out.packed_prompt_tokens = packed.prompt_tokens
        del out.packed_block_ids[:]
        del out.packed_blocks[:]
        out.packed_block_ids.extend(b.block_id for b in packed.blocks)
        out.packed_blocks.extend(packed.blocks)


def _below_cascade(completion: Completion, cascade_min_logprob: float) -> bool:
    """The confidence cascade escalates an answer whose mean token log-probability is below the threshold."""
    return (
        cascade_min_logprob < 0
        and completion.mean_logprob is not None
        and completion.mean_logprob < cascade_min_logprob
    )
