"""Pydantic schemas of the OpenAI-compatible HTTP API, plus agentjax's agent hints.

Requests validate here, before anything reaches the engine: a field of the wrong type or out of
range fails with a message that names it. Unknown top-level fields are ignored, as OpenAI clients
send many. Never imports jax.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 16
MAX_ID_LENGTH = 256
MAX_TOP_LOGPROBS = 20  # agentjax.sampling_params.MAX_LOGPROBS (this module imports nothing heavy)
MAX_N = 128
MAX_LOGIT_BIAS = 1024


def _at_most_stop_strings(value: Any) -> Any:
    """A list of stop strings over the limit fails on its length (else pydantic reports that the
    list is not a string, the union's other branch)."""
    if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
        raise PydanticCustomError("too_many_stop_strings", "at most {limit} stop strings are allowed, got {count}",
                                  {"limit": MAX_STOP_STRINGS, "count": len(value)})
    return value


StopStrings = Annotated[str | list[str] | None, BeforeValidator(_at_most_stop_strings)]


class OpenAIModel(BaseModel):
    """Base of every request schema: extra fields ignored, no NaN or infinity."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class AgentHintsModel(BaseModel):
    """What an agent harness tells the server about its session (all optional, strictly typed).

    Unknown fields are ignored; a known field of the wrong type is a 400.
    """

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    session_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    parent_session_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    turn: int | None = Field(None, ge=0, le=2**31 - 1)
    expected_next_turn_s: float | None = Field(None, ge=0, le=86_400)
    branch_point: bool | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    pin: Literal["none", "soft", "session"] | None = None
    session_end: bool | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIModel):
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    arguments: str = "{}"


class ToolCallModel(OpenAIModel):
    """A call the assistant made, as a client sends it back in the conversation."""

    id: str = Field(max_length=MAX_ID_LENGTH)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; extra fields (reasoning...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallModel] | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIModel):
    name: str | None = Field(None, max_length=MAX_ID_LENGTH)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str | None = Field(None, description="the served model's id (default: the served model)")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: StopStrings = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=MAX_N, description="parallel samples (they share the prompt's pages)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="vLLM's; 1 is off")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) -> value added to its logit; -100 bans it")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="vLLM's: log probabilities of the prompt's tokens")
    return_token_ids: bool = Field(False, description="vLLM's: the prompt's and each choice's token ids "
                                                      "(non-streamed replies)")
    user: str | None = None
    session_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    agent_hints: AgentHintsModel | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    cache_salt: str | None = Field(None, max_length=MAX_ID_LENGTH)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description="log probabilities of the reply's tokens")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token "
                                                                                  "(needs logprobs)")
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=64)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=64)
    ]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="log probabilities of the "
                                 "completion's tokens with this many alternatives")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="samples to draw; the n most likely return")
    echo: bool = Field(False, description="the prompt's text before the completion")
    suffix: str | None = Field(None, description="not supported; must be null")


class TokenizeRequest(OpenAIModel):
    """vLLM's `/tokenize`: a text `prompt`, or chat `messages` rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=1_000_000)]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ----------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallModel] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


def _now_seconds() -> int:
    return int(time.time())


class _CompletionEnvelope(BaseModel):
    """The fields every completion body and chunk opens with, in OpenAI's order (a subclass pins
    `object` to its own literal; an overridden field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=_now_seconds)
    model: str


class ChatCompletionResponse(_CompletionEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_CompletionEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(_CompletionEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now_seconds)
    owned_by: str = "agentjax"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
