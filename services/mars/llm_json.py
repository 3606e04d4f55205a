"""JSON-schema constrained chat completions against OpenAI-compatible servers: the transport shared by the
QTM controller and the rubric judge.

Dialects: `openai` sends `response_format: {type: json_schema, json_schema: {..., strict: true}}` (OpenAI,
vLLM's structured outputs); `llamacpp` sends llama-cpp-python's `{type: json_object, schema: ...}`, which its
server compiles to a grammar. Decoding is deterministic (temperature 0, fixed seed).

OpenAI's strict mode accepts a subset of JSON schema and answers HTTP 400 to anything else (every call
would then fall back). `strict_schema_violations` states that subset as a check; callers' schemas keep to
it, except string-length bounds, which the grammar dialect honours and `strict_subset` drops for `openai`.
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


# OpenAI structured outputs, "Supported schemas": the keywords strict mode accepts.
_STRICT_KEYWORDS: dict[str, frozenset[str]] = {
    "string": frozenset({"pattern", "format"}),
    "number": frozenset({"multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"}),
    "integer": frozenset({"multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "boolean": frozenset(),
    "null": frozenset(),
}
_ANY_NODE_KEYWORDS = frozenset({"type", "enum", "const", "anyOf", "description", "$ref", "$defs"})
_STRICT_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "null": (type(None),),
}
#: Strict-mode limits on one schema.
STRICT_MAX_DEPTH, STRICT_MAX_PROPERTIES, STRICT_MAX_ENUM_VALUES = 10, 5000, 1000
#: Bounds the grammar dialect enforces but strict mode rejects (dropped for `openai` by `strict_subset`).
_GRAMMAR_ONLY_KEYWORDS = frozenset({"minLength", "maxLength"})


def _node_violations(node: Any, path: str, depth: int, counts: dict[str, int]) -> list[str]:
    if not isinstance(node, dict):
        return [f"{path}: a schema must be an object, not {type(node).__name__}"]
    if depth > STRICT_MAX_DEPTH:
        return [f"{path}: nested deeper than {STRICT_MAX_DEPTH} levels"]
    found: list[str] = []
    if "anyOf" in node:
        branches = node["anyOf"]
        if not isinstance(branches, list) or not branches:
            return [f"{path}: anyOf must be a non-empty list"]
        for i, branch in enumerate(branches):
            found += _node_violations(branch, f"{path}.anyOf[{i}]", depth + 1, counts)
        return found + [f"{path}: '{k}' beside anyOf" for k in sorted(set(node) - {"anyOf", "description"})]
    if "$ref" in node:
        return []  # resolved against $defs by the server; our schemas inline everything
    declared = node.get("type")
    listed = declared if isinstance(declared, list) else [declared]
    types = [t for t in listed if isinstance(t, str) and t in _STRICT_KEYWORDS]
    if not listed or len(types) != len(listed):
        return [f"{path}: type {declared!r} is not one strict mode supports"]
    allowed = _ANY_NODE_KEYWORDS.union(*(_STRICT_KEYWORDS[t] for t in types))
    found += [f"{path}: keyword '{k}' is not supported in strict mode" for k in sorted(set(node) - allowed)]
    if "format" in node and node["format"] not in _STRICT_FORMATS:
        found.append(f"{path}: format {node['format']!r} is not supported in strict mode")
    if "enum" in node:
        values = node["enum"]
        counts["enum"] += len(values)
        python_types = tuple(py for t in types for py in _JSON_TYPES.get(t, ()))
        for value in values:
            # bool is an int in Python, never a JSON integer or number.
            if not isinstance(value, python_types) or (isinstance(value, bool) and "boolean" not in types):
                found.append(f"{path}: enum value {value!r} is not of type {declared!r}")
    if "object" in types:
        properties = node.get("properties", {})
        counts["properties"] += len(properties)
        if node.get("additionalProperties") is not False:
            found.append(f"{path}: an object needs additionalProperties: false")
        missing = set(properties) - set(node.get("required", []))
        if missing:
            found.append(f"{path}: every property must be required; not listed: {sorted(missing)}")
        unknown = set(node.get("required", [])) - set(properties)
        if unknown:
            found.append(f"{path}: required names unknown properties {sorted(unknown)}")
        for name, sub in properties.items():
            found += _node_violations(sub, f"{path}.{name}", depth + 1, counts)
    if "array" in types and "items" in node:
        found += _node_violations(node["items"], f"{path}[]", depth + 1, counts)
    for name, sub in node.get("$defs", {}).items():
        found += _node_violations(sub, f"{path}.$defs.{name}", depth + 1, counts)
    return found


def strict_schema_violations(schema: dict[str, Any]) -> list[str]:
    """Why OpenAI's strict structured outputs would reject `schema` (empty when it is accepted): the root is
    an object (not anyOf); every object sets additionalProperties: false and requires all its properties;
    only supported types and keywords; enum values of the declared type; depth, property and enum limits."""
    if not isinstance(schema, dict) or schema.get("type") != "object" or "anyOf" in schema:
        return ["root: the root must be an object schema (type: object, not anyOf)"]
    counts = {"properties": 0, "enum": 0}
    found = _node_violations(schema, "root", 1, counts)
    if counts["properties"] > STRICT_MAX_PROPERTIES:
        found.append(f"more than {STRICT_MAX_PROPERTIES} object properties in all")
    if counts["enum"] > STRICT_MAX_ENUM_VALUES:
        found.append(f"more than {STRICT_MAX_ENUM_VALUES} enum values in all")
    return found


def strict_subset(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` without the bounds only a grammar enforces (string lengths), for strict mode. Walks the
    subschemas only, so a property that happens to be named like a keyword is kept."""
    node = {k: v for k, v in schema.items() if k not in _GRAMMAR_ONLY_KEYWORDS}
    for key in ("properties", "$defs"):
        if isinstance(node.get(key), dict):
            node[key] = {name: strict_subset(sub) for name, sub in node[key].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = strict_subset(node["items"])
    if isinstance(node.get("anyOf"), list):
        node["anyOf"] = [strict_subset(sub) for sub in node["anyOf"]]
    return node


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
        strict = strict_subset(schema)
        return {"type": "json_schema", "json_schema": {"name": name, "schema": strict, "strict": True}}

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
