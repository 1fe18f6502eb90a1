"""Pydantic schemas of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Requests validate here, before anything reaches the engine: a field of the wrong type fails with a
message that names it, and a content block of a type this server cannot read is a 400 naming the
type. Unknown top-level fields are ignored, as harnesses send beta fields. Also the Anthropic
error shape and the status -> error type table. Never imports jax.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from agentjax.server.protocol import MAX_ID_LENGTH, MAX_STOP_STRINGS, AgentHintsModel

MAX_CACHE_MARKS = 4
CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}
MESSAGES_PATH = "/v1/messages"


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class CacheControl(AnthropicModel):
    """A cache breakpoint: the client will send the prefix up to this block again."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(AnthropicModel):
    """A call the assistant made, as the client sends it back."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _block_type(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# A tool result holds text; any other block type in it fails with pydantic's "tag" error naming it.
ToolResultPart = Annotated[Annotated[TextBlock, Tag("text")], Discriminator(_block_type)]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(_block_type),
]


class Message(AnthropicModel):
    """A turn; `system` turns inside `messages` (as Claude Code sends them) render as system turns
    where they stand."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    """A client tool. Server tools (`web_search_...`, `bash_...`) are not supported."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the input object (type: object)")
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError(f"input_schema must be a JSON schema with type 'object' (got type {schema.get('type')!r})")
        return schema


class ToolChoiceAuto(AnthropicModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(AnthropicModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(AnthropicModel):
    type: Literal["tool"]
    name: str = Field(min_length=1, max_length=128)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(AnthropicModel):
    type: Literal["none"]


AnthropicToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                                Field(discriminator="type")]


class Metadata(AnthropicModel):
    user_id: str | None = Field(None, max_length=4 * MAX_ID_LENGTH,
                                description="also the session id (its session_id, when it is a JSON object)")


class CountTokensRequest(AnthropicModel):
    """What `/v1/messages/count_tokens` renders: everything that goes into the prompt."""

    model: str = Field(description="the served model's id or an alias")
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_control: CacheControl | None = Field(None, description="a mark on the last block of the conversation")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: off")
    metadata: Metadata | None = None
    stream: bool = False
    # Accepted and ignored (logged): this server has no thinking mode, context editing or effort levels.
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # agentjax extensions, as on the OpenAI routes
    agent_hints: AgentHintsModel | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    cache_salt: str | None = Field(None, max_length=MAX_ID_LENGTH)


# ---- responses ----------------------------------------------------------------------------

class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape; the type follows the status (5xx: api_error)."""
    error_type = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def validation_message(errors: list[dict]) -> str:
    """One line naming the field (`messages.0.content.1: ...`) of the most telling validation error.

    Pydantic reports a `str | list[block]` field once per branch; the branch the input was meant
    for (the list, when a list was sent) is the one worth showing.
    """
    if not errors:
        return "the request is invalid"
    if errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {(errors[0].get('ctx') or {}).get('error', '')}".rstrip(": ")
    meant = [e for e in errors if "str" not in e.get("loc", ())] or errors
    chosen = max(meant, key=lambda e: len(e.get("loc", ())))
    path = _field_path(chosen.get("loc", ()))
    ctx = chosen.get("ctx") or {}
    if chosen["type"] == "union_tag_invalid":
        kind = "content block type" if "_block_type" in str(ctx.get("discriminator")) else "type"
        detail = f"{kind} {ctx.get('tag')!r} is not supported (supported: {ctx.get('expected_tags')})"
    elif chosen["type"] == "union_tag_not_found":
        detail = "a content block needs a 'type'"
    elif chosen["type"] == "list_type" and any(e["type"] == "string_type" and _field_path(e["loc"]) == path
                                                for e in errors):
        detail = "Input should be a string or a list of content blocks"
    else:
        detail = chosen.get("msg", "invalid")
    message = f"{path}: {detail}" if path else f"the request body is invalid: {detail}"
    others = len({_field_path(e.get("loc", ())) for e in meant} - {path})
    return message + (f"; and {others} more problem(s)" if others else "")


def _field_path(loc) -> str:
    """`messages.0.content.1.input` from a pydantic location, without union-branch and tag labels."""
    parts: list[str] = []
    tagged, skip_tag = False, False
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            parts.append(str(part))
            skip_tag, tagged = tagged, False
            continue
        if "[" in part or part == "str":
            tagged = tagged or "tagged-union" in part
            continue
        if skip_tag:
            skip_tag = False
            continue
        parts.append(part)
    return ".".join(parts)
