"""Tool-call parsers: they read a model's tool calls out of its streamed text.

A parser is fed the text as it is detokenised and gives back `TextPiece`s and whole `ToolCall`s.
Text that might still become a call is held back; a call that does not parse (bad JSON, an
unknown function) comes back as text, never as an error. Each parser also knows how to constrain
decoding so that the model must write a call in its format (`tool_choice` required or named).

- `hermes`: JSON inside `<tool_call>...</tool_call>` tags, as `checkpoints.tool_prompt` asks for.
- `json`: the whole reply is one JSON object `{"name", "arguments"}` or a list of them.

Never imports jax.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from agentjax.structured.spec import COMPACT_JSON, StructuredOutput
from checkpoints.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Function name -> its definition (`name`, `description`, `parameters`)."""
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of `{"name": ..., "arguments": ...}` for one function."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def calls_schema(functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    schemas = [call_schema(f) for f in functions]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def read_call(value: Any, known: Mapping[str, Any]) -> ToolCall | None:
    """A `ToolCall` from a decoded `{"name", "arguments" | "parameters"}` object, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in known:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """Base: streams text through; subclasses recognise calls. One instance per request."""

    name: ClassVar[str] = ""

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        self.known = tool_functions(tools)

    def feed(self, text: str, final: bool) -> list[TextPiece | ToolCall]:
        raise NotImplementedError

    @classmethod
    def constraint(cls, functions: Sequence[Mapping[str, Any]], parallel: bool) -> StructuredOutput:
        """Decoding that can only produce calls of `functions` in this parser's format."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among ordinary text."""

    name = "hermes"

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        super().__init__(tools)
        self.pending = ""
        self.inside = False
        self.whitespace = ""  # held: whitespace next to a call is not content
        self.after_call = False

    def _text(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append(TextPiece(self.whitespace + body))
            self.whitespace = ""
            self.after_call = False
        self.whitespace += text[len(body):]

    def feed(self, text: str, final: bool) -> list[TextPiece | ToolCall]:
        self.pending += text
        out: list[TextPiece | ToolCall] = []
        while True:
            if not self.inside:
                start = self.pending.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.pending, TOOL_CALL_OPEN)
                    self._text(self.pending[: len(self.pending) - keep], out)
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                self._text(self.pending[:start], out)
                self.pending = self.pending[start + len(TOOL_CALL_OPEN) :]
                self.inside = True
            end = self.pending.find(TOOL_CALL_CLOSE)
            if end < 0 and not final:
                break
            body = self.pending if end < 0 else self.pending[:end]
            call = self._parse(body)
            if call is not None:
                self.whitespace = ""
                self.after_call = True
                out.append(call)
            else:
                closing = "" if end < 0 else TOOL_CALL_CLOSE
                self._text(TOOL_CALL_OPEN + body + closing, out)
            self.pending = "" if end < 0 else self.pending[end + len(TOOL_CALL_CLOSE) :]
            self.inside = False
            if end < 0:
                break
        if final and self.whitespace and not self.after_call:
            out.append(TextPiece(self.whitespace))
            self.whitespace = ""
        return out

    def _parse(self, body: str) -> ToolCall | None:
        try:
            return read_call(json.loads(body), self.known)
        except json.JSONDecodeError:
            return None

    @classmethod
    def constraint(cls, functions: Sequence[Mapping[str, Any]], parallel: bool) -> StructuredOutput:
        schema = {**calls_schema(functions), "x-guidance": COMPACT_JSON}
        call = f'"{TOOL_CALL_OPEN}\\n" call_json "\\n{TOOL_CALL_CLOSE}"'
        start = "start: call (\"\\n\" call)*" if parallel else "start: call"
        return StructuredOutput.lark(f"{start}\ncall: {call}\ncall_json: %json {json.dumps(schema)}\n")


class JsonToolParser(ToolParser):
    """A reply that is one JSON call object, or a list of them; anything else is text."""

    name = "json"

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        super().__init__(tools)
        self.pending = ""
        self.mode: str | None = None  # None until the first non-space character: "json" or "text"

    def feed(self, text: str, final: bool) -> list[TextPiece | ToolCall]:
        if self.mode == "text":
            return [TextPiece(text)] if text else []
        self.pending += text
        stripped = self.pending.lstrip()
        if self.mode is None and stripped:
            self.mode = "json" if stripped[0] in "{[" else "text"
            if self.mode == "text":
                text, self.pending = self.pending, ""
                return [TextPiece(text)]
        if not final:
            return []
        calls = self._parse(self.pending)
        if calls:
            return calls
        return [TextPiece(self.pending)] if self.pending else []

    def _parse(self, text: str) -> list[ToolCall]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = [read_call(item, self.known) for item in items]
        return calls if calls and all(calls) else []

    @classmethod
    def constraint(cls, functions: Sequence[Mapping[str, Any]], parallel: bool) -> StructuredOutput:
        if not parallel:
            return StructuredOutput.json_schema(calls_schema(functions))
        return StructuredOutput.json_schema({"type": "array", "items": calls_schema(functions), "minItems": 1})


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, JsonToolParser)}
DEFAULT_TOOL_PARSER = "hermes"


def tool_parser_class(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None
