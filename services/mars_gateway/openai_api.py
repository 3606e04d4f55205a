"""The OpenAI chat API as the gateway serves it: request and response bodies (the subset MARS honours, the
rest accepted and ignored so existing clients work unchanged) plus the `mars` extension field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: The virtual model that lets MARS route (listed by GET /v1/models beside the pool's arms).
ROUTED_MODEL = "mars"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(description='"text" is read; any other part type is refused (400)')
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. The last message is the turn (it must be the user's); earlier user and
    assistant messages are the conversation, stored as memory once (MARS skips what it already holds);
    system messages are not memory. Sampling fields (temperature, top_p, ...) are accepted and ignored:
    MARS answers deterministically."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "model": "mars",
                    "user": "alice",
                    "metadata": {"session_id": "kyoto-trip"},
                    "messages": [
                        {"role": "user", "content": "Plan 3 days in Kyoto"},
                        {"role": "assistant", "content": "Day 1: Fushimi Inari ..."},
                        {"role": "user", "content": "Make day 2 less busy and add a tea ceremony"},
                    ],
                    "max_tokens": 64,
                }
            ]
        },
    )
    model: str = Field(default=ROUTED_MODEL, description='"mars" (MARS routes) or a pool arm from /v1/models')
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, description="answer tokens, 1..1024")
    max_completion_tokens: int | None = Field(default=None, description="newer name of max_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, description="only 1")
    user: str | None = Field(
        default=None,
        description="the end user; first found of: header X-MARS-User, user, safety_identifier, "
        "metadata.user_id (or a key scoped to one user)",
    )
    safety_identifier: str | None = Field(default=None, description="OpenAI's newer name for the end user")
    metadata: dict[str, str] | None = Field(
        default=None,
        description='"session_id" names the conversation (or header X-MARS-Session); "user_id" the end user',
    )
    tools: list[dict[str, Any]] | None = Field(default=None, description="not supported: refused when given")


class MarsExtension(BaseModel):
    """What MARS adds to a completion (`mars` field): the turn, its session state and view, and its cost."""

    turn_id: str
    seq: int
    state: dict[str, Any]
    view_blocks: int
    view_tokens: int
    cost_usd: float
    controller_cost_usd: float
    latency_ms: float
    trace_id: str
    attempts: list[dict[str, Any]]
    history_pairs: int = Field(description="earlier messages of the request sent to MARS as the conversation")
    restart: bool = Field(default=False, description="streaming: drop the text shown so far (a fallback arm)")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str = Field(description="the arm that answered")
    choices: list[Choice]
    usage: CompletionUsage
    mars: MarsExtension


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    mars: MarsExtension | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "mars"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class FeedbackBody(BaseModel):
    """POST /v1/feedback: a rating of an answered turn (the `mars.turn_id` of its completion)."""

    model_config = ConfigDict(extra="forbid")
    turn_id: str = Field(min_length=1, max_length=200)
    rating: float | None = Field(default=None, ge=0.0, le=1.0, description="in [0, 1]; or thumbs")
    thumbs: Literal[-1, 1] | None = Field(default=None, description="1 up (1.0), -1 down (0.0)")
    comment: str = Field(default="", max_length=4000)
    user: str | None = Field(default=None, description="the end user (or header X-MARS-User)")


class FeedbackResult(BaseModel):
    accepted: bool


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error format."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str = ""
