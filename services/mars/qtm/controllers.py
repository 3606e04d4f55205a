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
from typing import Any, Literal, Protocol

from mars.llm_json import Dialect, EndpointError, JsonChatClient, JsonReply
from mars.qtm.prompts import SYSTEM_ROLE, PromptTemplate
from mars.qtm.schema import qtm_json_schema

Backend = Literal["rules", "openai", "llamacpp", "vllm"]
BACKENDS: tuple[str, ...] = ("rules", "openai", "llamacpp", "vllm")


ControllerUnavailable = EndpointError
ControllerReply = JsonReply


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
        flavour: Dialect = "openai",
        api_key: str | None = None,
        timeout_s: float = 10.0,
        max_tokens: int = 200,
        seed: int = 0,
    ) -> None:
        self.name: str = flavour
        self.prompt_version = prompt.version
        self._prompt = prompt
        self._client = JsonChatClient(base_url, model, flavour, api_key, timeout_s, max_tokens, seed)

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        messages = [
            {"role": "system", "content": SYSTEM_ROLE},
            {"role": "user", "content": self._prompt.render(text, active_context)},
        ]
        return await self._client.complete(messages, qtm_json_schema(), "qtm_state")

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
    flavour: Dialect = "llamacpp" if backend == "llamacpp" else "openai"
    return OpenAICompatibleController(
        base_url, model or "qtm", template, flavour, api_key, timeout_s, max_tokens
    )
