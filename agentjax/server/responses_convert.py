"""Responses API requests -> the shared `ChatInput`, and the bounded store behind
`previous_response_id`.

`input` items become OpenAI-style chat messages: `message` items by role (`developer` renders as
`system`), consecutive `function_call` items one assistant message with `tool_calls`,
`function_call_output` items `tool` messages; `reasoning` items are skipped. `instructions` is a
system message in front, never carried over from a previous response. The store keeps, per
stored response, the conversation without instructions (its input and its reply) and the session
it ran in, so a chain continues one session. Never imports jax.
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agentjax.server.chat_path import ChatInput, ToolChoice
from agentjax.server.errors import APIError
from agentjax.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    ResponsesRequest,
    ToolChoiceFunction,
)
from agentjax.structured.spec import StructuredOutput

logger = logging.getLogger(__name__)

SKIPPED_ITEM_TYPES = ("reasoning",)  # this server writes no reasoning; a client may echo some back
ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem}


@dataclass
class StoredResponse:
    """What a later `previous_response_id` continues: the conversation so far (no instructions),
    the response itself (for GET), and its session."""

    messages: list[dict]
    response: dict
    session_id: str
    size: int  # characters of the conversation, for the store's bound
    namespace: str | None = None  # the tenant's (agentjax.server.tenancy): only it may read or continue it


class ResponseStore:
    """Responses by id, least recently used first out, bounded in count and in characters."""

    def __init__(self, max_responses: int = 512, max_chars: int = 64 * 2**20):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def get(self, response_id: str, namespace: str | None = None) -> StoredResponse | None:
        """The response, if it is there and was stored by a tenant of `namespace`."""
        stored = self.items.get(response_id)
        if stored is None or stored.namespace != namespace:
            return None
        self.items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self.items[response_id] = stored
        self.chars += stored.size
        while self.items and (len(self.items) > self.max_responses or self.chars > self.max_chars):
            _, dropped = self.items.popitem(last=False)
            self.chars -= dropped.size


def tools_of(body: ResponsesRequest) -> list[dict]:
    """Function tools as the chat path takes them; other tool types are ignored (logged)."""
    tools, ignored = [], []
    for index, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            ignored.append(str(tool.get("type")))
            continue
        try:
            function = FunctionTool.model_validate(tool)
        except ValidationError as error:
            raise APIError(f"tools[{index}]: {_first_error(error)}", param=f"tools[{index}]") from None
        tools.append({"type": "function", "function": {"name": function.name, "description": function.description or "",
                                                       "parameters": function.parameters or {"type": "object"}}})
    if ignored:
        logger.info("/v1/responses: ignoring tools of types %s (only function tools are supported)",
                    ", ".join(sorted(set(ignored))))
    return tools


def tool_choice_of(body: ResponsesRequest, tools: list[dict]) -> ToolChoice:
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return ToolChoice("function", choice.name)
    return ToolChoice(choice or ("auto" if tools else "none"))


def structured_of(body: ResponsesRequest) -> StructuredOutput | None:
    """`text.format` as a decoding constraint (plain text: none)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    if fmt.schema_ is None:
        raise APIError("text.format of type json_schema needs its schema", param="text.format.schema")
    return StructuredOutput.json_schema(fmt.schema_)


def chat_input_of(body: ResponsesRequest, history: list[dict]) -> tuple[ChatInput, list[dict]]:
    """(the chat to run, the conversation to store: `history` plus this input, no instructions)."""
    conversation = [*history, *input_messages(body.input, history)]
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    tools = tools_of(body)
    chat = ChatInput(messages, tools, tool_choice_of(body, tools), body.parallel_tool_calls, structured_of(body))
    return chat, conversation


def input_messages(value: str | list[dict[str, Any]], history: list[dict]) -> list[dict]:
    """`input` as chat messages; a `function_call_output` must answer a call made before it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    calls = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    out: list[dict] = []
    for index, raw in enumerate(value):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind in SKIPPED_ITEM_TYPES:
            continue
        model = ITEM_TYPES.get(kind)
        if model is None:
            raise APIError(f"input[{index}]: item type {kind!r} is not supported (supported: message, "
                           f"function_call, function_call_output, reasoning)", param=f"input[{index}].type")
        try:
            item = model.model_validate(raw)
        except ValidationError as error:
            raise APIError(f"input[{index}]: {_first_error(error)}", param=f"input[{index}]") from None
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text_of(item.content, f"input[{index}].content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise APIError(f"input[{index}]: no function_call with call_id {item.call_id!r} comes before this "
                               f"function_call_output", param=f"input[{index}].call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text_of(item.output, f"input[{index}].output")})
    return out


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for number, part in enumerate(content):
        try:
            text = InputText.model_validate(part)
        except ValidationError:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"{where}[{number}]: a {kind!r} part is not supported; only text parts are",
                           param=f"{where}[{number}]") from None
        texts.append(text.text if text.text is not None else (text.refusal or ""))
    return "".join(texts)


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    return f"{location}: {first.get('msg')}" if location else str(first.get("msg"))


def conversation_size(messages: list[dict]) -> int:
    return len(json.dumps(messages, ensure_ascii=False))
