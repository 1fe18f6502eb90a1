"""Pydantic schemas of OpenAI's Responses API (`POST /v1/responses`), as this server reads them.

The request validates here; the `input` items validate one by one in `responses_convert`, so a bad
item's error names it (`input[3].call_id`). Fields a server without reasoning, hosted tools or
storage beyond memory cannot honour (`reasoning`, `include`, `client_metadata`, `truncation`,
`service_tier`, ...) are accepted and ignored; unknown top-level fields too. Never imports jax.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentjax.server.protocol import MAX_ID_LENGTH, AgentHintsModel

MAX_INPUT_ITEMS = 10_000
MAX_TOOLS = 256


class ResponsesModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class InputText(ResponsesModel):
    """A text part: `input_text` (user, system, developer), `output_text` or `refusal` (assistant
    history), or a bare `text`."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class MessageItem(ResponsesModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(ResponsesModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    arguments: str = "{}"


class FunctionCallOutputItem(ResponsesModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    output: str | list[dict[str, Any]]


class FunctionTool(ResponsesModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ToolChoiceFunction(ResponsesModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH)


class TextFormat(ResponsesModel):
    """`text.format`: plain text, any JSON object, or JSON that matches `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=MAX_ID_LENGTH)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(ResponsesModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(ResponsesModel):
    model: str | None = Field(None, description="the served model's id (default: the served model)")
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)] = Field(
        description="text, or items: messages, function_call, function_call_output (reasoning items are skipped)")
    instructions: str | None = Field(None, description="a system message before the input (not carried over "
                                                       "from previous_response_id)")
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools; other tool types are ignored")
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per output token, reported "
                                                                   "with include: ['message.output_text.logprobs']")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
    prompt_cache_key: str | None = Field(None, max_length=4 * MAX_ID_LENGTH, description="the session id")
    store: bool = True
    metadata: dict[str, str] | None = None
    # Accepted and ignored: no reasoning mode, no hosted storage beyond this server's memory.
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    # agentjax extensions, as on the other routes
    agent_hints: AgentHintsModel | None = None
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1, description="lower runs first")
    cache_salt: str | None = Field(None, max_length=MAX_ID_LENGTH)


# ---- the reply (documentation for /openapi.json; the handler writes plain dicts) -------------

class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    incomplete_details: dict[str, Any] | None = None
