"""The model pool: generator arms loaded from a YAML file validated at start (no code change to edit)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

_ENV_REF = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")


#: The tokenizers a pool may name (mars.tokens loads them).
TOKENIZER_KINDS = ("gguf", "hf")


class ModelSpec(BaseModel):
    """One arm of the router: an OpenAI-compatible endpoint with its budget and prices."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    base_url: str = Field(min_length=1)
    #: Model id sent in the request body.
    model: str = "default"
    #: Name of the environment variable holding the API key; no key is sent when unset.
    api_key_env: str | None = None
    context_window: int = Field(gt=0)
    output_reserve: int = Field(gt=0)
    safety_margin: int = Field(ge=0)
    input_price_per_m: float = Field(ge=0)
    output_price_per_m: float = Field(ge=0)
    timeout_s: float = Field(default=60.0, gt=0)
    #: Calls in flight to this endpoint at most (further calls wait); unset = no limit.
    max_concurrency: int | None = Field(default=None, gt=0)
    #: Whether the endpoint returns token log-probabilities (needed by the confidence cascade).
    returns_logprobs: bool = False
    #: Tokenizer for exact packing: gguf:<path> or hf:<tokenizer.json>; none = conservative estimate.
    tokenizer: str | None = None

    @model_validator(mode="after")
    def _budget_positive(self) -> ModelSpec:
        if self.context_window - self.output_reserve - self.safety_margin <= 0:
            raise ValueError(f"{self.name}: context_window must exceed output_reserve + safety_margin")
        if self.tokenizer and self.tokenizer.partition(":")[0] not in TOKENIZER_KINDS:
            raise ValueError(
                f"{self.name}: tokenizer {self.tokenizer!r} is not gguf:<path> or hf:<tokenizer.json>"
            )
        return self

    @property
    def input_budget(self) -> int:
        return self.context_window - self.output_reserve - self.safety_margin

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_price_per_m + output_tokens * self.output_price_per_m) / 1e6

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class ModelPool(BaseModel):
    models: list[ModelSpec] = Field(min_length=1)
    #: Order in which arms are tried after the chosen one fails; defaults to file order.
    fallback_order: list[str] | None = None

    @model_validator(mode="after")
    def _names_unique(self) -> ModelPool:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names in pool: {names}")
        for name in self.fallback_order or []:
            if name not in names:
                raise ValueError(f"fallback_order names unknown model {name!r}")
        return self

    @property
    def arms(self) -> list[str]:
        return [m.name for m in self.models]

    def get(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def cheapest_first(self) -> list[str]:
        """Arms by price (input + output per million tokens), cheapest first; ties keep file order."""
        return [m.name for m in sorted(self.models, key=lambda m: m.input_price_per_m + m.output_price_per_m)]

    def fallbacks_after(self, chosen: str) -> list[str]:
        order = self.fallback_order or self.arms
        return [a for a in order if a != chosen]


class PoolFileError(ValueError):
    pass


def _expand_env(text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        value = os.environ.get(m.group(1), m.group(2))
        if value is None:
            raise PoolFileError(f"model pool refers to ${{{m.group(1)}}}, which is not set")
        return value

    return _ENV_REF.sub(repl, text)


def load_pool(path: str | Path) -> ModelPool:
    """Read and validate the pool file; `${VAR}` and `${VAR:-default}` are taken from the environment."""
    p = Path(path)
    try:
        raw = yaml.safe_load(_expand_env(p.read_text(encoding="utf-8")))
    except OSError as exc:
        raise PoolFileError(f"cannot read model pool {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PoolFileError(f"model pool {p} is not valid YAML: {exc}") from exc
    try:
        return ModelPool.model_validate(raw)
    except ValidationError as exc:
        raise PoolFileError(f"model pool {p} is invalid: {exc}") from exc
