"""The judge service's settings (MARS_* variables): one typed model, read only here."""

from __future__ import annotations

from typing import ClassVar, Literal

from mars.config import ServiceSettings
from mars.domain.feedback import FeedbackMode
from pydantic import Field


class JudgeSettings(ServiceSettings):
    #: Its own settings are read as MARS_JUDGE_<FIELD> (mars.config.env_name).
    env_section: ClassVar[str] = "JUDGE"
    #: Cost weight lambda of Eq. 17 (paper Table 8: 0.002 main RealMem run, 0.5 ablations).
    lambda_cost: float = 0.002
    #: Per-tenant lambda, e.g. MARS_JUDGE_LAMBDA_TENANTS='{"budget-co": 0.5}' (a tenant's cost sensitivity).
    lambda_tenants: dict[str, float] = Field(default_factory=dict)
    #: deterministic (default: lexical signals only), openai (any OpenAI-compatible judge endpoint), or
    #: llamacpp (the local stack's server); the LLM judges fall back to deterministic when they fail.
    judge_backend: Literal["deterministic", "openai", "llamacpp"] = "deterministic"
    judge_url: str = ""
    judge_model: str = "judge"
    #: Name of the environment variable holding the judge endpoint's API key.
    judge_api_key_env: str = "MARS_JUDGE_API_KEY"
    judge_prompt: str = "judge-v1"
    #: Eq. 17 profile (B.5): realmem, or multichallenge (its penalties, and M averaging in revision
    #: application with coverage as 1).
    judge_profile: str = "realmem"
    judge_deadline_ms: int = 10_000
    judge_max_tokens: int = 200
    #: Judge prices per million tokens (B.6: GPT-4o-mini).
    judge_price_input_per_m: float = 0.15
    judge_price_output_per_m: float = 0.60
    #: Set by the local stack launcher: its llama.cpp server.
    local_llm_url: str = ""
    #: What user feedback does to the reward (appendix G.1): log (default), replace, or blend.
    feedback_mode: FeedbackMode = "log"
    #: Per-tenant override, e.g. MARS_JUDGE_FEEDBACK_TENANT_MODES='{"acme": "replace"}'.
    feedback_tenant_modes: dict[str, FeedbackMode] = Field(default_factory=dict)
    #: Weight of the user's rating in blend mode: u = (1 - w) * u_judge + w * rating.
    feedback_blend_weight: float = 0.5

    def feedback_mode_for(self, tenant: str) -> str:
        return self.feedback_tenant_modes.get(tenant, self.feedback_mode)

    def lambda_for(self, tenant: str) -> float:
        return self.lambda_tenants.get(tenant, self.lambda_cost)
