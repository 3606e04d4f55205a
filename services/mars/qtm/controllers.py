"""QTM controller backends behind one small interface (paper Appendix B.1-B.2).

- `openai`: any OpenAI-compatible server with JSON-schema constrained output (`response_format` with a
  JSON schema, which vLLM's structured outputs honour): how production reaches vLLM serving
  Qwen2.5-7B-Instruct.
- `llamacpp`: the local llama.cpp server of the default stack (llama-cpp-python's schema-constrained
  `json_object` response format, compiled to a grammar).
- `vllm`: an in-process vLLM engine on a GPU node with guided JSON decoding; vllm is imported only
  when this backend is selected (an optional extra, never needed for tests).

Rule-based estimation (`rules`) is not a Controller: it is synchronous, never fails, and is the
fallback the guard (`mars.qtm.guard`) uses whatever backend is configured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

from mars.domain.text import estimate_tokens
from mars.qtm.prompts import SYSTEM_ROLE, PromptTemplate
from mars.qtm.schema import qtm_json_schema

Backend = Literal["rules", "openai", "llamacpp", "vllm"]
BACKENDS: tuple[str, ...] = ("rules", "openai", "llamacpp", "vllm")


class ControllerUnavailable(RuntimeError):
    """The controller endpoint could not be reached or answered with an error."""


@dataclass(frozen=True)
class ControllerReply:
    #: What the model wrote (the guard parses and clamps it).
    text: str
    input_tokens: int
    output_tokens: int
    #: True when the server reported no usage and the counts were estimated from text length.
    usage_estimated: bool


class Controller(Protocol):
    name: str
    prompt_version: str

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        """The controller's raw answer with its usage; raises ControllerUnavailable when the endpoint fails."""
        ...

    async def aclose(self) -> None: ...


class OpenAICompatibleController:
    """Chat completions against an OpenAI-compatible server, deterministic decoding (temperature 0,
    fixed seed), output constrained to the QTM JSON schema in the dialect of `flavour`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt: PromptTemplate,
        flavour: Literal["openai", "llamacpp"] = "openai",
        api_key: str | None = None,
        timeout_s: float = 10.0,
        max_tokens: int = 200,
        seed: int = 0,
    ) -> None:
        self.name: str = flavour
        self.prompt_version = prompt.version
        self._prompt = prompt
        self._model = model
        self._flavour = flavour
        self._max_tokens = max_tokens
        self._seed = seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(2.0, timeout_s)),
            limits=httpx.Limits(max_connections=8, max_keepalive_connections=8),
        )

    def _response_format(self) -> dict[str, Any]:
        schema = qtm_json_schema()
        if self._flavour == "llamacpp":
            return {"type": "json_object", "schema": schema}
        return {"type": "json_schema", "json_schema": {"name": "qtm_state", "schema": schema, "strict": True}}

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        prompt = self._prompt.render(text, active_context)
        body = {
            "model": self._model,
            "messages": [{"role": "system", "content": SYSTEM_ROLE}, {"role": "user", "content": prompt}],
            "temperature": 0.0,
            "seed": self._seed,
            "max_tokens": self._max_tokens,
            "response_format": self._response_format(),
        }
        try:
            resp = await self._client.post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise ControllerUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise ControllerUnavailable(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
            content = data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ControllerUnavailable(f"malformed completion response: {exc}") from exc
        usage = data.get("usage") or {}
        tokens_in, tokens_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        estimated = not (isinstance(tokens_in, int) and isinstance(tokens_out, int))
        return ControllerReply(
            text=content,
            input_tokens=tokens_in if isinstance(tokens_in, int) else estimate_tokens(SYSTEM_ROLE + prompt),
            output_tokens=tokens_out if isinstance(tokens_out, int) else estimate_tokens(content),
            usage_estimated=estimated,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class VllmController:
    """An in-process vLLM engine with guided JSON decoding (GPU nodes; `pip install vllm`)."""

    def __init__(self, model: str, prompt: PromptTemplate, max_tokens: int = 200, seed: int = 0) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:  # an optional extra: say how to get it instead of a bare traceback
            raise ImportError(
                "the 'vllm' QTM backend needs vllm on a GPU node (pip install vllm); "
                "use MARS_QTM_BACKEND=openai to reach a vLLM server instead"
            ) from exc
        self.name = "vllm"
        self.prompt_version = prompt.version
        self._prompt = prompt
        self._llm = LLM(model=model, seed=seed)
        self._tokenizer = self._llm.get_tokenizer()
        params: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens, "seed": seed}
        try:  # vLLM >= 0.10 names it structured outputs; older releases guided decoding
            from vllm.sampling_params import StructuredOutputsParams

            params["structured_outputs"] = StructuredOutputsParams(json=qtm_json_schema())
        except ImportError:
            from vllm.sampling_params import GuidedDecodingParams

            params["guided_decoding"] = GuidedDecodingParams(json=qtm_json_schema())
        self._params = SamplingParams(**params)

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        messages = [
            {"role": "system", "content": SYSTEM_ROLE},
            {"role": "user", "content": self._prompt.render(text, active_context)},
        ]
        prompt = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The offline engine is synchronous; a worker thread keeps the event loop (and Kafka) alive.
        outputs = await asyncio.to_thread(self._llm.generate, [prompt], self._params, use_tqdm=False)
        out = outputs[0]
        content = out.outputs[0].text
        return ControllerReply(
            text=content,
            input_tokens=len(out.prompt_token_ids or []),
            output_tokens=len(out.outputs[0].token_ids),
            usage_estimated=False,
        )

    async def aclose(self) -> None:
        return None


def make_controller(
    backend: str,
    *,
    base_url: str = "",
    model: str = "",
    prompt: str = "qtm-v1",
    api_key: str | None = None,
    timeout_s: float = 10.0,
    max_tokens: int = 200,
) -> Controller | None:
    """The configured controller, or None for `rules` (the guard answers from rules alone)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown QTM backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "rules":
        return None
    template = PromptTemplate.load(prompt)
    if backend == "vllm":
        if not model:
            raise ValueError("the vllm QTM backend needs a model path (MARS_QTM_MODEL)")
        return VllmController(model, template, max_tokens)
    if not base_url:
        raise ValueError(f"the {backend} QTM backend needs an endpoint (MARS_QTM_URL)")
    flavour: Literal["openai", "llamacpp"] = "llamacpp" if backend == "llamacpp" else "openai"
    return OpenAICompatibleController(
        base_url, model or "qtm", template, flavour, api_key, timeout_s, max_tokens
    )
