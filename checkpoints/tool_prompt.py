"""Tools for chat templates that do not know about them: fold the tool list, the assistant's tool
calls and the tool results into plain system, assistant and user messages.

The wording and tags follow the common JSON-in-tags convention (`<tools>`, `<tool_call>`,
`<tool_response>`), which the `hermes` tool parser reads back. Rendering a call the way the model
wrote it keeps the next turn's prompt a prefix-cache hit. Host only: never imports jax.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

TOOLS_INSTRUCTIONS = """You can call functions to help with the request. The functions you may call are listed below, one JSON object per line, inside <tools></tools> tags:
<tools>
{tool_lines}
</tools>

To call a function, reply with one <tool_call></tool_call> block per call. Each block holds one JSON object with the function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>
Results come back inside <tool_response></tool_response> tags."""


def template_supports_tools(source: str) -> bool:
    """Whether a chat template renders `tools` itself (then it gets them, and the messages, as sent)."""
    return "tools" in source


def needs_tool_folding(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def render_tool_call(name: str, arguments: Any) -> str:
    """One call as the model is asked to write it; `arguments` text is kept verbatim."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments or "{}"}}}\n{TOOL_CALL_CLOSE}'


def _function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    return tool.get("function", tool) if tool.get("type", "function") == "function" else tool


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(_function_of(tool), ensure_ascii=False) for tool in tools)
    return TOOLS_INSTRUCTIONS.format(tool_lines=lines)


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return json.dumps(content, ensure_ascii=False)


def fold_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    """Messages with only system/user/assistant roles and string contents, tools written into them."""
    folded: list[dict] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"{TOOL_RESPONSE_OPEN}\n{_text_of(message.get('content'))}\n{TOOL_RESPONSE_CLOSE}"
            if folded and folded[-1].get("_tool_results"):
                folded[-1]["content"] += "\n" + response
            else:
                folded.append({"role": "user", "content": response, "_tool_results": True})
            continue
        item = {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")}
        item["content"] = _text_of(message.get("content"))
        if role == "user" and folded and folded[-1].get("_tool_results"):
            # One user turn, so templates that insist on alternating roles (Gemma's) still render.
            folded[-1]["content"] += "\n" + item["content"]
            folded[-1]["_tool_results"] = False
            continue
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            rendered = [render_tool_call(call["function"]["name"], call["function"].get("arguments", "{}"))
                        for call in calls]
            item["content"] = "\n".join(([item["content"]] if item["content"] else []) + rendered)
        folded.append(item)
    for item in folded:
        item.pop("_tool_results", None)
    if tools:
        instructions = tools_system_text(tools)
        if folded and folded[0].get("role") in ("system", "developer"):
            system = folded[0]["content"]
            folded[0] = {**folded[0], "role": "system",
                         "content": f"{system}\n\n{instructions}" if system else instructions}
        else:
            folded.insert(0, {"role": "system", "content": instructions})
    return folded
