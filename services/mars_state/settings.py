"""The state service's settings (MARS_* variables): one typed model, read only here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from mars.config import ServiceSettings
from pydantic import Field


class StateSettings(ServiceSettings):
    #: Its own settings are read as MARS_STATE_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "STATE"
    #: MARS_CONTEXT_TURNS meant this here and the secondary queries in memory (MARS_MEMORY_CONTEXT_TURNS).
    renamed_from: ClassVar[Mapping[str, str]] = {"state_context_turns": "MARS_CONTEXT_TURNS"}

    #: User turns of the active thread shown to the controller as PREVIOUS ACTIVE CONTEXT.
    state_context_turns: int = 6
    #: QTM backend: learned (the packaged CPU model over MiniLM features, default), rules (deterministic
    #: cues), openai (any OpenAI-compatible server, e.g. vLLM with Qwen2.5-7B-Instruct), llamacpp (the local
    #: stack's server), vllm (in-process engine on a GPU node).
    qtm_backend: str = "learned"
    #: Endpoint base URL including /v1; for llamacpp it defaults to the local stack's server.
    qtm_url: str = ""
    #: Model name (openai / llamacpp) or model path (vllm).
    qtm_model: str = ""
    #: Name of the environment variable holding the endpoint's API key (never the key itself).
    qtm_api_key_env: str = "MARS_QTM_API_KEY"
    #: Prompt template version (mars_state/qtm/prompts) or path to a template file.
    qtm_prompt: str = "qtm-v1"
    #: After this the rules backend answers the turn (the controller call is abandoned).
    qtm_deadline_ms: int = 1500
    qtm_max_tokens: int = 200
    #: In-process vllm backend: calls in flight (running or queued on its one engine thread); beyond it a
    #: turn falls back to the rules at once instead of queueing behind a busy engine.
    qtm_max_in_flight: int = Field(default=4, ge=1)
    #: Controller prices per million tokens (Table 10: Qwen2.5-7B-Instruct).
    qtm_price_input_per_m: float = 0.04
    qtm_price_output_per_m: float = 0.10
    #: Set by the local stack launcher: its llama.cpp server.
    local_llm_url: str = ""
    #: learned backend: the model file (`mars train qtm` writes one); "" = the one shipped in the package.
    #: A missing or corrupt file leaves the rules answering, with health entry
    #: mars.v1.StateEstimator.learned_model NOT_SERVING.
    qtm_learned_model: str = ""
    #: learned backend: folder of the embedder's ONNX exports (the memory service's setting of that name).
    embedding_cache_dir: str | None = None
