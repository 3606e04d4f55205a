"""Generation dispatch: packs the candidate view for the chosen arm (Eq. 13), calls its OpenAI-compatible
endpoint, falls back to the next arm with a fresh packing on failure, and accounts the generator cost."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import httpx
from mars.bus import EventProducer, StageConsumer, StageOutput, Subscription
from mars.config import TOPIC_GENERATED, TOPIC_ROUTED, TOPIC_TOKENS, ServiceSettings
from mars.domain.circuit import CircuitBreaker
from mars.domain.packing import PackedPrompt, input_budget, pack_view
from mars.domain.text import estimate_tokens
from mars.pool import ModelPool, ModelSpec, load_pool
from mars.runtime import GrpcBinding, ServiceContext, ServiceParts, run
from mars.tokens import load_counter
from mars.v1 import events_pb2 as ev
from mars.v1 import services_pb2 as svc
from mars.v1 import services_pb2_grpc as svc_grpc
from psycopg_pool import AsyncConnectionPool

log = logging.getLogger(__name__)

STAGE = "dispatch"


class DispatchSettings(ServiceSettings):
    model_pool: str = "config/models.local.yaml"
    default_max_tokens: int = 96
    #: Extra attempts on the same arm for a retryable error (connection trouble, 429, 5xx).
    retries_per_arm: int = 1
    #: Consecutive failed calls after which an arm's circuit opens (turns fall back at once).
    circuit_failure_threshold: int = 5
    #: Seconds an open circuit waits before one trial call may close it again.
    circuit_reset_s: float = 30.0
    #: The MEMORY GUIDANCE state header (continuation or topic shift, query type, phase, scope, recency,
    #: lens) in the generator prompt (Fig. 5). False leaves it out, memory blocks and clipping unchanged:
    #: the paper's "No QTM state/header" ablation (mars_semctx_noactive, with MARS_VIEW_POLICY=semantic,
    #: whose view has no active-thread state block either).
    state_header: bool = True


class GenerationError(Exception):
    pass


@dataclass
class Completion:
    text: str
    input_tokens: int
    output_tokens: int
    usage_estimated: bool
    mean_logprob: float | None = None


class ModelClients:
    """One pooled HTTP client per endpoint."""

    def __init__(self, pool: ModelPool, retries: int) -> None:
        self._clients = {
            m.name: httpx.AsyncClient(base_url=m.base_url.rstrip("/"), timeout=m.timeout_s)
            for m in pool.models
        }
        # Calls beyond an endpoint's max_concurrency wait here instead of overloading it.
        self._slots = {
            m.name: asyncio.Semaphore(m.max_concurrency) for m in pool.models if m.max_concurrency is not None
        }
        self._retries = retries

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))

    async def complete(
        self,
        spec: ModelSpec,
        packed: PackedPrompt,
        max_tokens: int,
        want_logprobs: bool = False,
        timeout_s: float | None = None,
    ) -> Completion:
        headers = self._headers(spec)
        body = {
            "model": spec.model,
            "messages": packed.messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if want_logprobs and spec.returns_logprobs:
            # top_logprobs >= 1 as well: llama.cpp's server returns none without it.
            body["logprobs"] = True
            body["top_logprobs"] = 1
        async with self._slot(spec):
            return await self._post(spec, body, headers, packed, timeout_s)

    def _slot(self, spec: ModelSpec) -> contextlib.AbstractAsyncContextManager[object]:
        """The endpoint's concurrency slot (max_concurrency), or no limit."""
        slot = self._slots.get(spec.name)
        return slot if slot is not None else contextlib.nullcontext()

    @staticmethod
    def _headers(spec: ModelSpec) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if (key := spec.api_key()) else {}

    async def _post(
        self,
        spec: ModelSpec,
        body: dict[str, object],
        headers: dict[str, str],
        packed: PackedPrompt,
        timeout_s: float | None,
    ) -> Completion:
        last: Exception | None = None
        timeout = min(spec.timeout_s, timeout_s) if timeout_s is not None else spec.timeout_s
        for attempt in range(self._retries + 1):
            try:
                resp = await self._clients[spec.name].post(
                    "/chat/completions", json=body, headers=headers, timeout=timeout
                )
            except httpx.HTTPError as exc:
                last = GenerationError(f"{type(exc).__name__}: {exc}")
            else:
                if resp.status_code == 200:
                    return self._parse(resp.json(), packed)
                last = GenerationError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                if resp.status_code not in (408, 429) and resp.status_code < 500:
                    break  # not retryable
            if attempt < self._retries:
                # Backoff with jitter, so replicas retrying one endpoint do not arrive in lockstep.
                await asyncio.sleep(0.1 * (attempt + 1) * random.uniform(0.5, 1.5))
        assert last is not None
        raise last

    async def stream(
        self,
        spec: ModelSpec,
        packed: PackedPrompt,
        max_tokens: int,
        on_delta: Callable[[str], Awaitable[None]],
        timeout_s: float | None = None,
    ) -> Completion:
        """Chat completion with `stream: true` (server-sent events): each content delta goes to `on_delta`
        as it arrives. Retried like `complete` only while nothing has been streamed yet."""
        headers = self._headers(spec)
        body = {
            "model": spec.model,
            "messages": packed.messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with self._slot(spec):
            return await asyncio.wait_for(self._stream(spec, body, headers, packed, on_delta), timeout_s)

    async def _stream(
        self,
        spec: ModelSpec,
        body: dict[str, object],
        headers: dict[str, str],
        packed: PackedPrompt,
        on_delta: Callable[[str], Awaitable[None]],
    ) -> Completion:
        last: Exception | None = None
        for attempt in range(self._retries + 1):
            parts: list[str] = []
            usage: dict[str, int] = {}
            try:
                async with self._clients[spec.name].stream(
                    "POST", "/chat/completions", json=body, headers=headers
                ) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")
                        raise GenerationError(f"HTTP {resp.status_code}: {text[:200]}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        try:
                            chunk = json.loads(data)
                        except ValueError as exc:
                            raise GenerationError(f"malformed stream chunk: {data[:80]!r}") from exc
                        if isinstance(chunk.get("usage"), dict):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            piece = (choice.get("delta") or {}).get("content")
                            if piece:
                                parts.append(piece)
                                await on_delta(piece)
            except (httpx.HTTPError, GenerationError) as exc:
                last = (
                    exc
                    if isinstance(exc, GenerationError)
                    else GenerationError(f"{type(exc).__name__}: {exc}")
                )
                if parts:
                    raise last from exc  # tokens already went out: the caller falls back, not a retry
                if attempt < self._retries:
                    await asyncio.sleep(0.1 * (attempt + 1) * random.uniform(0.5, 1.5))
                continue
            text = "".join(parts)
            if "prompt_tokens" in usage:
                return Completion(
                    text, int(usage["prompt_tokens"]), int(usage.get("completion_tokens", 0)), False
                )
            return Completion(text, packed.prompt_tokens, estimate_tokens(text), True)
        assert last is not None
        raise last

    @staticmethod
    def _parse(payload: dict[str, object], packed: PackedPrompt) -> Completion:
        try:
            choices = payload["choices"]
            text = str(choices[0]["message"]["content"] or "")  # type: ignore[index]
        except (KeyError, IndexError, TypeError) as exc:
            raise GenerationError(f"malformed completion: {exc!r}") from exc
        mean_logprob = None
        try:
            tokens = choices[0].get("logprobs", {}).get("content") or []  # type: ignore[index]
            values = [float(t["logprob"]) for t in tokens if t.get("logprob") is not None]
            mean_logprob = sum(values) / len(values) if values else None
        except (AttributeError, TypeError, ValueError, KeyError):
            mean_logprob = None  # logprobs are optional; a malformed block is ignored, not fatal
        usage = payload.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            return Completion(
                text, int(usage["prompt_tokens"]), int(usage.get("completion_tokens", 0)), False, mean_logprob
            )
        return Completion(text, packed.prompt_tokens, estimate_tokens(text), True, mean_logprob)


class Dispatcher:
    def __init__(self, pool: ModelPool, clients: ModelClients, settings: DispatchSettings) -> None:
        self._pool = pool
        self._clients = clients
        self._settings = settings
        self.breakers = {
            m.name: CircuitBreaker(settings.circuit_failure_threshold, settings.circuit_reset_s)
            for m in pool.models
        }

    async def generate(
        self,
        arms: list[str],
        text: str,
        state: ev.SessionState,
        view: ev.CandidateView,
        max_tokens: int,
        cascade_min_logprob: float = 0.0,
        on_delta: Callable[[str, str, bool], Awaitable[None]] | None = None,
        deadline_ms: int = 0,
    ) -> ev.Generated:
        """Try each arm in order; each attempt packs the view for that arm's own budget.

        With a cascade threshold (< 0), an answer whose mean token log-probability is below it is kept
        only as a provisional answer and the next arm is asked; every call's cost is counted.
        With `on_delta(arm, text, restart)` the answer is streamed (not with the cascade, which needs the
        whole answer's log-probabilities first); `restart` marks the first piece of a fallback arm after
        another arm streamed part of an answer and failed."""
        out = ev.Generated(status=ev.FAILED, query=text, state=state)
        started = time.perf_counter()
        streamed_any = False
        for arm in arms:
            spec = self._pool.get(arm)
            # The caller's deadline bounds every call: nobody waits for an answer after it.
            remaining_s = (deadline_ms - time.time() * 1000) / 1000 if deadline_ms else None
            t0 = time.perf_counter()
            packed = pack_view(
                view,
                text,
                state,
                input_budget(spec.context_window, spec.output_reserve, spec.safety_margin),
                load_counter(spec.tokenizer),
                state_header=self._settings.state_header,
            )
            attempt = ev.GenerationAttempt(
                arm=arm,
                packed_prompt_tokens=packed.prompt_tokens,
                packed_blocks=len(packed.blocks),
                clipped_blocks=len(packed.clipped_block_ids),
            )
            breaker = self.breakers[arm]
            if not packed.fits:
                attempt.error = f"query and active state exceed the input budget of {arm}"
            elif remaining_s is not None and remaining_s <= 0:
                attempt.error = f"the turn's deadline passed before {arm} was called"
            elif not breaker.allow():
                attempt.error = (
                    f"circuit open for {arm}: {breaker.failure_threshold} failed calls in a row; "
                    f"a trial call goes through {breaker.reset_after_s:g}s after the last failure"
                )
            else:
                try:
                    if on_delta is not None and cascade_min_logprob >= 0:
                        first = True

                        async def forward(piece: str, arm: str = arm) -> None:
                            nonlocal first, streamed_any
                            await on_delta(arm, piece, first and streamed_any)
                            first, streamed_any = False, True

                        completion = await self._clients.stream(
                            spec, packed, min(max_tokens, spec.output_reserve), forward, remaining_s
                        )
                    else:
                        completion = await asyncio.wait_for(
                            self._clients.complete(
                                spec,
                                packed,
                                min(max_tokens, spec.output_reserve),
                                want_logprobs=cascade_min_logprob < 0,
                                timeout_s=remaining_s,
                            ),
                            remaining_s,
                        )
                except TimeoutError:
                    breaker.record_failure()
                    attempt.error = f"{arm} did not finish before the turn's deadline"
                except GenerationError as exc:
                    breaker.record_failure()
                    attempt.error = str(exc)
                else:
                    breaker.record_success()
                    attempt.ok = True
                    out.status = ev.OK
                    out.model = arm
                    out.text = completion.text
                    out.usage.CopyFrom(
                        ev.Usage(
                            input_tokens=completion.input_tokens,
                            output_tokens=completion.output_tokens,
                            estimated=completion.usage_estimated,
                        )
                    )
                    out.cost_usd += spec.cost_usd(completion.input_tokens, completion.output_tokens)
                    if completion.mean_logprob is not None:
                        attempt.mean_logprob = completion.mean_logprob
                        attempt.has_logprob = True
                    out.packed_prompt_tokens = packed.prompt_tokens
                    del out.packed_block_ids[:]
                    del out.packed_blocks[:]
                    out.packed_block_ids.extend(b.block_id for b in packed.blocks)
                    out.packed_blocks.extend(packed.blocks)
                    low = (
                        cascade_min_logprob < 0
                        and completion.mean_logprob is not None
                        and completion.mean_logprob < cascade_min_logprob
                    )
                    attempt.escalated = low and arm != arms[-1]
            attempt.latency_ms = (time.perf_counter() - t0) * 1000
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


class DispatchStage:
    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: DispatchSettings,
        producer: EventProducer,
        pg: AsyncConnectionPool,
    ) -> None:
        self._dispatcher = dispatcher
        self._settings = settings
        self._producer = producer
        self._out = StageOutput(pg, producer, STAGE, TOPIC_GENERATED)

    async def on_routed(self, event: ev.Routed) -> None:
        turn = event.turn
        if await self._out.done(turn.turn_id):
            return
        max_tokens = int(turn.options.get("max_tokens", self._settings.default_max_tokens))
        on_delta = None
        if turn.options.get("stream") == "true":
            index = 0

            async def on_delta(arm: str, piece: str, restart: bool) -> None:
                nonlocal index
                chunk = ev.TokenChunk(turn=turn, arm=arm, index=index, text=piece, restart=restart)
                index += 1
                await self._producer.publish(TOPIC_TOKENS, chunk, turn)

        out = await self._dispatcher.generate(
            [event.chosen_arm, *event.fallback_order],
            event.text,
            event.state,
            event.view,
            max_tokens,
            event.cascade_min_logprob,
            on_delta,
            turn.deadline_ms,
        )
        out.turn.CopyFrom(turn)
        out.controller_cost_usd = event.state.usage.cost_usd
        out.features.extend(event.features)
        out.policy_id = event.policy_id
        out.propensity = event.propensity
        await self._out.emit(out, turn)


class DispatchServicer(svc_grpc.DispatchServicer):
    def __init__(self, dispatcher: Dispatcher, pool: ModelPool, settings: DispatchSettings) -> None:
        self._dispatcher = dispatcher
        self._pool = pool
        self._settings = settings

    async def Generate(self, request: svc.GenerateRequest, context: grpc.aio.ServicerContext) -> ev.Generated:
        if request.arm not in self._pool.arms:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unknown arm {request.arm!r}; known: {self._pool.arms}"
            )
        if not request.text.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text is empty")
        remaining = context.time_remaining()
        return await self._dispatcher.generate(
            [request.arm],
            request.text,
            request.state,
            request.view,
            request.max_tokens or self._settings.default_max_tokens,
            deadline_ms=int((time.time() + remaining) * 1000) if remaining is not None else 0,
        )

    async def ListModels(self, request: svc.Empty, context: grpc.aio.ServicerContext) -> svc.ModelList:
        return svc.ModelList(
            models=[
                svc.ModelInfo(
                    name=m.name,
                    context_window=m.context_window,
                    input_budget=m.input_budget,
                    input_price_per_m=m.input_price_per_m,
                    output_price_per_m=m.output_price_per_m,
                    circuit=self._dispatcher.breakers[m.name].state,
                )
                for m in self._pool.models
            ]
        )


def _circuit_closed(breaker: CircuitBreaker) -> bool:
    return breaker.state != "open"


async def build(ctx: ServiceContext) -> ServiceParts:
    settings = ctx.settings
    assert isinstance(settings, DispatchSettings)
    pool_cfg = load_pool(settings.model_pool)
    clients = ModelClients(pool_cfg, settings.retries_per_arm)
    dispatcher = Dispatcher(pool_cfg, clients, settings)
    stage = DispatchStage(dispatcher, settings, ctx.producer, ctx.pool)
    consumer = StageConsumer(
        settings,
        ctx.producer,
        "dispatch",
        "mars-dispatch",
        [Subscription(TOPIC_ROUTED, ev.Routed, stage.on_routed)],
    )
    return ServiceParts(
        bindings=[
            GrpcBinding(
                svc_grpc.add_DispatchServicer_to_server,
                DispatchServicer(dispatcher, pool_cfg, settings),
                "mars.v1.Dispatch",
            )
        ],
        consumers=[consumer],
        on_stop=[clients.close],
        # One health entry per arm: NOT_SERVING while its circuit is open.
        health_probes={
            f"mars.v1.Dispatch.arm.{name}": functools.partial(_circuit_closed, breaker)
            for name, breaker in dispatcher.breakers.items()
        },
    )


def main() -> None:
    run("dispatch", DispatchSettings(), build)
