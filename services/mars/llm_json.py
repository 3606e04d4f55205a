"""JSON-schema constrained chat completions against OpenAI-compatible servers: the transport shared by the
QTM controller and the rubric judge.

Dialects: `openai` sends `response_format: {type: json_schema, json_schema: {...}}` (OpenAI, vLLM's
structured outputs); `llamacpp` sends llama-cpp-python's `{type: json_object, schema: ...}`, which its
server compiles to a grammar. Decoding is deterministic (temperature 0, fixed seed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from mars.domain.text import estimate_tokens

Dialect = Literal["openai", "llamacpp"]


@dataclass(frozen=True)
class TokenPrices:
    """USD per million tokens in and out (the controller and the judge price their calls with it)."""

    input_per_million: float
    output_per_million: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_million + output_tokens * self.output_per_million) / 1e6


def endpoint_url(url: str, backend: str, local_llm_url: str) -> str:
    """The configured endpoint; for the llamacpp backend without one, the local stack's server."""
    if not url and backend == "llamacpp" and local_llm_url:
        return local_llm_url.rstrip("/") + "/v1"
    return url


class EndpointError(RuntimeError):
    """The endpoint could not be reached, answered with an error, or sent a malformed response."""


@dataclass(frozen=True)
class JsonReply:
    #: What the model wrote (callers parse and validate it).
    text: str
    input_tokens: int
    output_tokens: int
    #: True when the server reported no usage and the counts were estimated from text length.
    usage_estimated: bool


class JsonChatClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        dialect: Dialect = "openai",
        api_key: str | None = None,
        timeout_s: float = 10.0,
        max_tokens: int = 200,
        seed: int = 0,
    ) -> None:
        self.dialect = dialect
        self._model = model
        self._max_tokens = max_tokens
        self._seed = seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(2.0, timeout_s)),
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=8),
        )

    def _response_format(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        if self.dialect == "llamacpp":
            return {"type": "json_object", "schema": schema}
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}

    async def complete(self, messages: list[dict[str, str]], schema: dict[str, Any], name: str) -> JsonReply:
        body = {
            "model": self._model,
            "messages": messages,
            "temperature": 0.0,
            "seed": self._seed,
            "max_tokens": self._max_tokens,
            "response_format": self._response_format(name, schema),
        }
        try:
            resp = await self._client.post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EndpointError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
            content = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"malformed completion response: {exc}") from exc
        usage = data.get("usage") or {}
        tokens_in, tokens_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(tokens_in, int) and isinstance(tokens_out, int):
            return JsonReply(content, tokens_in, tokens_out, usage_estimated=False)
        prompt_text = "".join(m.get("content", "") for m in messages)
        return JsonReply(
            content, estimate_tokens(prompt_text), estimate_tokens(content), usage_estimated=True
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class NoJsonObject(ValueError):
    """The model's text holds no JSON object."""


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def parse_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in `text`: bare, inside a ``` fence, or after chatter. Values are not
    checked here (callers validate them). Raises NoJsonObject when there is none."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        start = candidate.find("{")
        while start != -1:
            try:
                obj, _ = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                start = candidate.find("{", start + 1)
                continue
            if isinstance(obj, dict):
                return obj
            start = candidate.find("{", start + 1)
    raise NoJsonObject(f"no JSON object in the model's output ({len(text)} chars)")
