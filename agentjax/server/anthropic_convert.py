"""Anthropic Messages requests -> the shared `ChatInput`, and `cache_control` marks -> page pins.

`tool_use` blocks become assistant `tool_calls` (arguments = the input as JSON text), `tool_result`
blocks become `tool` messages, system blocks one system message, and `system` turns inside
`messages` system messages where they stand. A `cache_control` mark pins the
prompt prefix it closes: the conversation up to and including the marked block is rendered
without a generation prompt, and the pin covers its longest common prefix with the full prompt
(so a pin never covers a token the full prompt does not have). Never imports jax.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agentjax.errors import AgentjaxError
from agentjax.server.anthropic_protocol import (
    CACHE_TTL_S,
    MAX_CACHE_MARKS,
    CountTokensRequest,
    Message,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from agentjax.server.chat_path import ChatInput, ChatPath, ToolChoice
from agentjax.server.errors import APIError

logger = logging.getLogger(__name__)

ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads to the model


@dataclass(frozen=True)
class CacheMark:
    """Where a `cache_control` mark sits: tool `index`, system block `index`, or block `block` of
    message `index` (-1: the whole message)."""

    where: str  # tools, system or messages
    index: int
    block: int
    ttl_s: float


def chat_input_of(body: CountTokensRequest) -> ChatInput:
    """The request as the chat path takes it; 400 for a tool_result that answers no tool_use."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or ()]
    choice = body.tool_choice
    parallel = not getattr(choice, "disable_parallel_tool_use", False)
    if choice is None:
        tool_choice = ToolChoice("auto" if tools else "none")
    elif isinstance(choice, ToolChoiceNone):
        tool_choice = ToolChoice("none")
    elif isinstance(choice, ToolChoiceAny):
        tool_choice = ToolChoice("required")
    elif isinstance(choice, ToolChoiceTool):
        tool_choice = ToolChoice("function", choice.name)
    else:
        tool_choice = ToolChoice("auto")
    return ChatInput(_messages(body.system, body.messages), tools, tool_choice, parallel)


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


def _messages(system: str | list[TextBlock] | None, messages: Sequence[Message]) -> list[dict]:
    out: list[dict] = []
    text = _system_text(system)
    if text:
        out.append({"role": "system", "content": text})
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "system":
            out.append({"role": "system", "content": _system_turn_text(message, index)})
            continue
        texts, calls, results = [], [], []
        for number, block in enumerate(message.content):
            where = f"messages.{index}.content.{number}"
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise APIError(f"{where}: a tool_use block belongs in an assistant message", param=where)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
                call_ids.add(block.id)
            elif isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise APIError(f"{where}: a tool_result block belongs in a user message", param=where)
                if block.tool_use_id not in call_ids:
                    raise APIError(f"{where}.tool_use_id: {block.tool_use_id!r} matches no tool_use block in an "
                                   f"earlier assistant message", param=f"{where}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        # Results first: they answer the previous assistant turn's calls; the user's text follows.
        out.extend(results)
        if texts or calls or not results:
            item = {"role": message.role, "content": "".join(texts)}
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def _system_turn_text(message: Message, index: int) -> str:
    texts = []
    for number, block in enumerate(message.content):
        if not isinstance(block, TextBlock):
            where = f"messages.{index}.content.{number}"
            raise APIError(f"{where}: a system turn holds text blocks only (got {block.type})", param=where)
        texts.append(block.text)
    return "\n".join(texts)


def _result_text(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        text = "".join(part.text for part in block.content)
    return ERROR_PREFIX + text if block.is_error else text


# ---- cache_control -> pins -----------------------------------------------------------------

def cache_marks(body: CountTokensRequest) -> list[CacheMark]:
    """Every `cache_control` mark, in prompt order; more than 4 is a 400."""
    marks = [CacheMark("tools", i, -1, CACHE_TTL_S[t.cache_control.ttl])
             for i, t in enumerate(body.tools or ()) if t.cache_control]
    if isinstance(body.system, list):
        marks += [CacheMark("system", i, -1, CACHE_TTL_S[b.cache_control.ttl])
                  for i, b in enumerate(body.system) if b.cache_control]
    for index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for number, block in enumerate(message.content):
            control = block.cache_control
            if control is None and isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                control = next((part.cache_control for part in block.content if part.cache_control), None)
            if control is not None:
                marks.append(CacheMark("messages", index, number, CACHE_TTL_S[control.ttl]))
    if body.cache_control is not None:  # the top-level mark: on the last block of the last message
        last = body.messages[-1]
        block = -1 if isinstance(last.content, str) else len(last.content) - 1
        marks.append(CacheMark("messages", len(body.messages) - 1, block, CACHE_TTL_S[body.cache_control.ttl]))
    if len(marks) > MAX_CACHE_MARKS:
        raise APIError(f"{len(marks)} blocks carry cache_control; at most {MAX_CACHE_MARKS} may",
                       param="cache_control")
    return marks


def marked_prefix(body: CountTokensRequest, chat: ChatInput, mark: CacheMark) -> ChatInput:
    """The conversation up to and including the marked block (Anthropic's order: tools, system,
    messages)."""
    if mark.where == "tools":  # templates need a message; tools render into the system one
        return replace(chat, messages=[{"role": "system", "content": ""}], tools=chat.tools[: mark.index + 1])
    if mark.where == "system":
        return replace(chat, messages=_messages(body.system[: mark.index + 1], []))
    message = body.messages[mark.index]
    cut = message if mark.block < 0 else message.model_copy(update={"content": message.content[: mark.block + 1]})
    return replace(chat, messages=_messages(body.system, [*body.messages[: mark.index], cut]))


def pin_prefixes(path: ChatPath, body: CountTokensRequest, chat: ChatInput,
                 prompt: Sequence[int]) -> list[tuple[int, float]]:
    """`(num_tokens, ttl_s)` per mark: how much of `prompt` the marked prefix covers."""
    pins: dict[int, float] = {}
    for mark in cache_marks(body):
        try:
            prefix = path.prompt_ids(marked_prefix(body, chat, mark), add_generation_prompt=False)
        except AgentjaxError as error:  # a pin is only a hint: a template that cannot render the cut skips it
            logger.info("cache_control mark %s not pinned: %s", mark, error)
            continue
        covered = common_prefix_length(prefix, prompt)
        if covered > 0:
            pins[covered] = max(pins.get(covered, 0.0), mark.ttl_s)
    return sorted(pins.items())


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
