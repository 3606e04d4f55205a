"""QTM controller backends behind one small interface (paper Appendix B.1-B.2).

- `openai`: any OpenAI-compatible server with JSON-schema constrained output (`response_format` with a
  JSON schema, which vLLM's structured outputs honour): how production reaches vLLM serving
  Qwen2.5-7B-Instruct.
- `llamacpp`: the local llama.cpp server of the default stack (llama-cpp-python's schema-constrained
  `json_object` response format, compiled to a grammar).
- `vllm`: an in-process vLLM engine on a GPU node with guided JSON decoding, driven one call at a time
  with a cap on calls in flight (`mars_state.qtm.serial_engine`); vllm is imported only when this backend is
  selected (an optional extra, never needed for tests).

Rule-based estimation (`rules`) is not a Controller: it is synchronous, never fails, and is the
fallback the guard (`mars_state.qtm.guard`) uses whatever backend is configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from mars.llm_json import Dialect, EndpointError, JsonChatClient, JsonReply

from mars_state.qtm.prompts import SYSTEM_ROLE, PromptTemplate
from mars_state.qtm.schema import qtm_json_schema
from mars_state.qtm.serial_engine import SerialEngine

Backend = Literal["rules", "learned", "openai", "llamacpp", "vllm"]
BACKENDS: tuple[str, ...] = ("rules", "learned", "openai", "llamacpp", "vllm")


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


class OfflineEngine(Protocol):
    """What the controller uses of vLLM's offline `LLM` (a test can stand in for it)."""

    def get_tokenizer(self) -> Any: ...

    def generate(self, prompts: list[str], sampling_params: Any, *, use_tqdm: bool) -> list[Any]: ...


def vllm_sampling_params(max_tokens: int, seed: int) -> Any:
    """Deterministic decoding constrained to the QTM JSON schema, in the installed vLLM's spelling."""
    from vllm import SamplingParams

    params: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens, "seed": seed}
    try:  # vLLM >= 0.10 names it structured outputs; older releases guided decoding
        from vllm.sampling_params import StructuredOutputsParams

        params["structured_outputs"] = StructuredOutputsParams(json=qtm_json_schema())
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        params["guided_decoding"] = GuidedDecodingParams(json=qtm_json_schema())
    return SamplingParams(**params)


class VllmController:
    """An in-process vLLM engine with guided JSON decoding (GPU nodes; `pip install vllm`).

    The offline engine is not thread-safe and a `generate` cannot be stopped once started, so every call
    (chat template and generate) runs on one worker thread, one at a time, at most `max_in_flight`
    admitted (`SerialEngine`); past that, or when generate fails, the call raises ControllerUnavailable
    and the guard answers from the rules.
    """

    def __init__(
        self, engine: OfflineEngine, sampling_params: Any, prompt: PromptTemplate, max_in_flight: int = 4
    ) -> None:
        self.name = "vllm"
        self.prompt_version = prompt.version
        self._prompt = prompt
        self._engine = engine
        self._params = sampling_params
        self._serial = SerialEngine(max_in_flight, name="vllm-engine")

    @classmethod
    def load(
        cls, model: str, prompt: PromptTemplate, max_tokens: int = 200, seed: int = 0, max_in_flight: int = 4
    ) -> VllmController:
        """Load `model` into an offline vLLM engine on this node's GPU."""
        try:
            from vllm import LLM
        except ImportError as exc:  # an optional extra: say how to get it instead of a bare traceback
            raise ImportError(
                "the 'vllm' QTM backend needs vllm on a GPU node (pip install vllm); "
                "use MARS_STATE_QTM_BACKEND=openai to reach a vLLM server instead"
            ) from exc
        engine = LLM(model=model, seed=seed)
        return cls(engine, vllm_sampling_params(max_tokens, seed), prompt, max_in_flight)

    @property
    def in_flight(self) -> int:
        return self._serial.in_flight

    def _generate(self, messages: list[dict[str, str]]) -> ControllerReply:
        """One blocking call on the engine's worker thread (the tokenizer is the engine's, so it too)."""
        tokenizer = self._engine.get_tokenizer()
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = self._engine.generate([prompt], self._params, use_tqdm=False)[0]
        return ControllerReply(
            text=out.outputs[0].text,
            input_tokens=len(out.prompt_token_ids or []),
            output_tokens=len(out.outputs[0].token_ids),
            usage_estimated=False,
        )

    async def call(self, text: str, active_context: Sequence[str]) -> ControllerReply:
        messages = [
            {"role": "system", "content": SYSTEM_ROLE},
            {"role": "user", "content": self._prompt.render(text, active_context)},
        ]
        try:
            return await self._serial.run(lambda: self._generate(messages))
        except ControllerUnavailable:
            raise
        except Exception as exc:  # an engine error is an endpoint error: the guard falls back to rules
            raise ControllerUnavailable(f"vllm generate failed: {exc!r}") from exc

    async def aclose(self) -> None:
        self._serial.close()


def make_controller(
    backend: str,
    *,
    base_url: str = "",
    model: str = "",
    prompt: str = "qtm-v1",
    api_key: str | None = None,
    timeout_s: float = 10.0,
    max_tokens: int = 200,
    max_in_flight: int = 4,
    embedding_cache_dir: str | None = None,
) -> Controller | None:
    """The configured controller, or None for `rules` (the guard answers from rules alone).

    `max_in_flight` caps the in-process vllm backend's admitted calls (running and queued). `learned`
    loads its model file (`model`, default the packaged one; mars_state.qtm.learned.ModelFileError when it is
    missing or corrupt) and the MiniLM embedder (ONNX exports under `embedding_cache_dir`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown QTM backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "rules":
        return None
    if backend == "learned":
        from pathlib import Path

        from mars.retrieval.embedder import LruEmbedder, embedder_tag, load_embedder

        from mars_state.qtm.learned import DEFAULT_MODEL, LearnedController, LearnedModel

        learned = LearnedModel.load(Path(model) if model else DEFAULT_MODEL)
        cache = LruEmbedder(load_embedder(cache_dir=embedding_cache_dir))
        return LearnedController(learned, cache.encode, cache.clear, cache.cached, embedder_tag(None))
    template = PromptTemplate.load(prompt)
    if backend == "vllm":
        if not model:
            raise ValueError("the vllm QTM backend needs a model path (MARS_STATE_QTM_MODEL)")
        return VllmController.load(model, template, max_tokens, max_in_flight=max_in_flight)
    if not base_url:
        raise ValueError(f"the {backend} QTM backend needs an endpoint (MARS_STATE_QTM_URL)")
    flavour: Dialect = "llamacpp" if backend == "llamacpp" else "openai"
    return OpenAICompatibleController(
        base_url, model or "qtm", template, flavour, api_key, timeout_s, max_tokens
    )
