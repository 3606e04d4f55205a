"""The model pool: generator arms loaded from a YAML file validated at start (no code change to edit)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

_ENV_REF = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")
#: What an arm's api_key_env may name: an upper-case variable ending in _API_KEY or _TOKEN.
API_KEY_ENV_PATTERN = r"^[A-Z][A-Z0-9_]*_(API_KEY|TOKEN)$"
#: Names of that shape that hold MARS's own secrets, never a provider's key.
MARS_SECRETS = frozenset({"MARS_API_KEY"})


#: The tokenizers a pool may name (mars.tokens loads them).
TOKENIZER_KINDS = ("gguf", "hf")


class ModelSpec(BaseModel):
    """One arm of the router: an OpenAI-compatible endpoint with its budget and prices."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    base_url: str = Field(min_length=1)
    #: Model id sent in the request body.
    model: str = "default"
    #: Name of the environment variable holding the API key; no key is sent when unset. Only a provider-key
    #: name (…_API_KEY or …_TOKEN, API_KEY_ENV_PATTERN) that is not one of MARS's own secrets: a pool that
    #: could name any variable could send the Postgres or Kafka password to an endpoint it points at.
    api_key_env: str | None = Field(default=None, pattern=API_KEY_ENV_PATTERN)
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
        if self.api_key_env in MARS_SECRETS:
            raise ValueError(
                f"{self.name}: api_key_env {self.api_key_env} is a MARS secret, not a provider's key"
            )
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


def _expand_env(value: Any) -> Any:
    """`${VAR}` and `${VAR:-default}` in every string of the parsed pool. After parsing, so a variable's
    value is one scalar, whatever it holds: expanded into the text first, a newline and YAML in it could
    add keys (an api_key_env of the value's choosing)."""

    def repl(m: re.Match[str]) -> str:
        found = os.environ.get(m.group(1), m.group(2))
        if found is None:
            raise PoolFileError(f"model pool refers to ${{{m.group(1)}}}, which is not set")
        return found

    if isinstance(value, str):
        return _ENV_REF.sub(repl, value)
    if isinstance(value, list):
        return [_expand_env(v) for v in value]
    if isinstance(value, dict):
        return {k: _expand_env(v) for k, v in value.items()}
    return value


def load_pool(path: str | Path) -> ModelPool:
    """Read and validate the pool file; `${VAR}` and `${VAR:-default}` are taken from the environment."""
    p = Path(path)
    try:
        raw = _expand_env(yaml.safe_load(p.read_text(encoding="utf-8")))
    except OSError as exc:
        raise PoolFileError(f"cannot read model pool {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise PoolFileError(f"model pool {p} is not valid YAML: {exc}") from exc
    try:
        return ModelPool.model_validate(raw)
    except ValidationError as exc:
        raise PoolFileError(f"model pool {p} is invalid: {exc}") from exc
