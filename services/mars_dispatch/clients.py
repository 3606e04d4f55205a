"""OpenAI-compatible chat-completion calls to the pool's endpoints: one pooled HTTP client per endpoint,
its concurrency slots, retries with backoff, and the caller's deadline over all of it.

What went wrong is told apart, because only the endpoint's own failures count against its circuit:
`GenerationError` is the endpoint's failure (connection, HTTP status, its own timeout, an answer that is not
a chat completion); `DeadlineExceeded` is the turn's deadline cutting the call, the caller's limit, not the
endpoint's fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from mars.domain.packing import PackedPrompt
from mars.domain.text import estimate_tokens
from mars.model_pool import ModelPool, ModelSpec

#: HTTP statuses worth another attempt on the same endpoint (besides connection trouble).
_RETRYABLE_STATUS = frozenset({408, 429})


class GenerationError(Exception):
    """The endpoint failed the call. `retryable`: another attempt on the same endpoint may succeed.
    `body`: what the endpoint sent back (a piece of it), for the dispatch log only: it can hold model output
    or the upstream's internals, so it stays out of the message, which travels on events and to callers."""

    def __init__(self, message: str, retryable: bool = False, body: str = "") -> None:
        super().__init__(message)
        self.retryable = retryable
        self.body = body


class DeadlineExceeded(Exception):
    """The caller's deadline cut the call. `endpoint_error` is the endpoint's failure on an earlier attempt
    of the same call, if there was one (then the endpoint did fail, whatever the deadline)."""

    def __init__(self, endpoint_error: GenerationError | None) -> None:
        super().__init__("the caller's deadline passed during the call")
        self.endpoint_error = endpoint_error


@dataclass
class Completion:
    text: str
    input_tokens: int
    output_tokens: int
    usage_estimated: bool
    mean_logprob: float | None = None


def _status_retryable(status: int) -> bool:
    return status in _RETRYABLE_STATUS or status >= 500


def _chat_body(spec: ModelSpec, packed: PackedPrompt, max_tokens: int) -> dict[str, object]:
    """The chat-completions request both the plain and the streamed call send (deterministic decoding)."""
    return {"model": spec.model, "messages": packed.messages, "max_tokens": max_tokens, "temperature": 0.0}


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
        """One chat completion. `timeout_s` is the caller's deadline (from now) over the slot wait, every
        attempt and the backoff between them; the endpoint's own `timeout_s` bounds each attempt."""
        headers = self._headers(spec)
        body = _chat_body(spec, packed, max_tokens)
        if want_logprobs and spec.returns_logprobs:
            # top_logprobs >= 1 as well: llama.cpp's server returns none without it.
            body["logprobs"] = True
            body["top_logprobs"] = 1

        async def once() -> Completion:
            try:
                resp = await self._clients[spec.name].post(
                    "/chat/completions", json=body, headers=headers, timeout=spec.timeout_s
                )
            except httpx.HTTPError as exc:
                raise GenerationError(f"{type(exc).__name__}: {exc}", retryable=True) from exc
            if resp.status_code != 200:
                raise GenerationError(
                    f"HTTP {resp.status_code}", _status_retryable(resp.status_code), body=resp.text[:200]
                )
            return _parse_completion(resp, packed)

        return await self._call(spec, once, timeout_s)

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
        body = _chat_body(spec, packed, max_tokens)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}

        async def once() -> Completion:
            parts: list[str] = []
            try:
                return await self._stream_once(spec, body, headers, packed, on_delta, parts)
            except httpx.HTTPError as exc:
                raise GenerationError(f"{type(exc).__name__}: {exc}", retryable=not parts) from exc
            except GenerationError as exc:
                # Tokens already went out: the caller falls back to another arm, no retry here.
                exc.retryable = exc.retryable and not parts
                raise

        return await self._call(spec, once, timeout_s)

    async def _call(
        self, spec: ModelSpec, once: Callable[[], Awaitable[Completion]], timeout_s: float | None
    ) -> Completion:
        """The endpoint's slot, then attempts with backoff, all under the caller's deadline."""
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        last: GenerationError | None = None
        cut = asyncio.timeout_at(deadline)
        try:
            async with cut, self._slot(spec):
                for attempt in range(self._retries + 1):
                    try:
                        return await once()
                    except GenerationError as exc:
                        last = exc
                        if not exc.retryable or attempt == self._retries:
                            raise
                    # Backoff with jitter, so replicas retrying one endpoint do not arrive in lockstep.
                    await asyncio.sleep(0.1 * (attempt + 1) * random.uniform(0.5, 1.5))
        except TimeoutError as exc:
            if cut.expired():
                raise DeadlineExceeded(last) from exc
            raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _slot(self, spec: ModelSpec) -> contextlib.AbstractAsyncContextManager[object]:
        """The endpoint's concurrency slot (max_concurrency), or no limit."""
        slot = self._slots.get(spec.name)
        return slot if slot is not None else contextlib.nullcontext()

    @staticmethod
    def _headers(spec: ModelSpec) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if (key := spec.api_key()) else {}

    async def _stream_once(
        self,
        spec: ModelSpec,
        body: dict[str, object],
        headers: dict[str, str],
        packed: PackedPrompt,
        on_delta: Callable[[str], Awaitable[None]],
        parts: list[str],
    ) -> Completion:
        usage: object = None
        async with self._clients[spec.name].stream(
            "POST", "/chat/completions", json=body, headers=headers, timeout=spec.timeout_s
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise GenerationError(
                    f"HTTP {resp.status_code}", _status_retryable(resp.status_code), body=text[:200]
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError as exc:
                    raise GenerationError("malformed stream chunk", retryable=True, body=data[:80]) from exc
                if not isinstance(chunk, dict):
                    raise GenerationError("malformed stream chunk", retryable=True, body=data[:80])
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for piece in _delta_pieces(chunk):
                    parts.append(piece)
                    await on_delta(piece)
        text = "".join(parts)
        counted = _usage(usage)
        if counted is not None:
            return Completion(text, counted[0], counted[1], False)
        return Completion(text, packed.prompt_tokens, estimate_tokens(text), True)


def _delta_pieces(chunk: dict[str, object]) -> list[str]:
    choices = chunk.get("choices")
    pieces: list[str] = []
    for choice in choices if isinstance(choices, list) else []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        piece = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(piece, str) and piece:
            pieces.append(piece)
    return pieces


def _usage(usage: object) -> tuple[int, int] | None:
    """(prompt, completion) tokens as the endpoint counted them, or None when it did not say (or said
    something that is not a count): the caller estimates then."""
    if not isinstance(usage, dict) or "prompt_tokens" not in usage:
        return None
    try:
        return int(usage["prompt_tokens"]), int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        return None


def _mean_logprob(choice: dict[str, object]) -> float | None:
    """Mean token log-probability; logprobs are optional, so a missing or malformed block gives None."""
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
    try:
        values = [float(t["logprob"]) for t in tokens or [] if t.get("logprob") is not None]
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return sum(values) / len(values) if values else None


def _parse_completion(resp: httpx.Response, packed: PackedPrompt) -> Completion:
    """A 200 answer as a Completion; any body that is not a chat completion is the endpoint's failure
    (so the turn falls back to the next arm), never an exception of another kind."""
    try:
        payload = resp.json()
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise GenerationError("HTTP 200 with a body that is not JSON", body=resp.text[:80]) from exc
    try:
        choice = payload["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise GenerationError(f"malformed completion ({type(exc).__name__})", body=resp.text[:80]) from exc
    if not isinstance(choice, dict) or not isinstance(content, str | None):
        raise GenerationError(f"malformed completion: content is {type(content).__name__}")
    text = content or ""
    mean_logprob = _mean_logprob(choice)
    counted = _usage(payload.get("usage"))
    if counted is not None:
        return Completion(text, counted[0], counted[1], False, mean_logprob)
    return Completion(text, packed.prompt_tokens, estimate_tokens(text), True, mean_logprob)
