"""Tool-call parsers: they read a model's tool calls out of its streamed text.

A parser is fed the text as it is detokenised and gives back `TextPiece`s and `ToolCall`s. A
parser that streams calls sends `ToolCallStart` (id and name) as soon as a known function's
arguments object opens, then `ToolCallArguments` fragments as they are decoded, then the whole
`ToolCall` (its arguments are exactly the fragments joined). Text that might still become a call
is held back; a call that does not parse before its arguments begin (bad JSON, an unknown
function) comes back as text, never as an error; a streamed call whose arguments break off (cut
by max_tokens, or malformed) ends with the arguments as written. Each parser also knows how to
constrain decoding so that the model must write a call in its format (`tool_choice` required or
named).

- `hermes`: JSON inside `<tool_call>...</tool_call>` tags, as `checkpoints.tool_prompt` asks for;
  streams calls whose JSON starts with `"name"` and then `"arguments"` (or `"parameters"`).
- `json`: the whole reply is one JSON object `{"name", "arguments"}` or a list of them; calls
  come out whole at the end.

Never imports jax.
"""
from __future__ import annotations

import json
import re
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


@dataclass(frozen=True)
class ToolCallStart:
    """A call's id and name, sent before its arguments (streaming parsers only)."""

    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of the arguments of the call started last."""

    text: str


ParsedPiece = TextPiece | ToolCallStart | ToolCallArguments | ToolCall


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

    def feed(self, text: str, final: bool) -> list[ParsedPiece]:
        raise NotImplementedError

    @classmethod
    def constraint(cls, functions: Sequence[Mapping[str, Any]], max_calls: int) -> StructuredOutput:
        """Decoding that can only produce 1 to `max_calls` calls of `functions` in this parser's
        format, and can end after any of them."""
        raise NotImplementedError


# `{"name": "...", "arguments": ` up to the arguments object's brace: enough to start streaming.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.){1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_HEAD_SEARCH_LIMIT = 1024  # a body this long without the head will not stream


class _StreamedCall:
    """A call whose arguments object is being streamed: where it starts in the call's body, how far
    it has been scanned (JSON nesting, strings) and sent, and where it ended."""

    def __init__(self, call_id: str, name: str, args_start: int):
        self.id, self.name = call_id, name
        self.args_start = self.scanned = self.sent = args_start
        self.depth, self.in_string, self.escape = 0, False, False
        self.args_end: int | None = None

    def scan(self, body: str, limit: int) -> str:
        """Reads `body` up to `limit`; returns the newly readable part of the arguments."""
        index = self.scanned
        while self.args_end is None and index < limit:
            char = body[index]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.args_end = index + 1
            elif char == "<":  # never outside a string in JSON: the call broke off (a closing tag?)
                self.args_end = index
                break
            index += 1
        self.scanned = index
        upto = self.args_end if self.args_end is not None else index
        fragment, self.sent = body[self.sent:upto], max(self.sent, upto)
        return fragment

    def call(self, body: str) -> ToolCall:
        end = self.args_end if self.args_end is not None else self.sent
        return ToolCall(self.id, self.name, body[self.args_start:end])


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among ordinary text."""

    name = "hermes"

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        super().__init__(tools)
        self.pending = ""
        self.inside = False
        self.whitespace = ""  # held: whitespace next to a call is not content
        self.after_call = False
        self.streamed: _StreamedCall | None = None  # the call being streamed, once its head is read

    def _text(self, text: str, out: list) -> None:
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append(TextPiece(self.whitespace + body))
            self.whitespace = ""
            self.after_call = False
        self.whitespace += text[len(body):]

    def _stream(self, body: str, limit: int, out: list) -> None:
        """Starts streaming once the call's head is read, then sends the arguments read so far."""
        if self.streamed is None:
            if len(body) > _HEAD_SEARCH_LIMIT:
                return
            head = _CALL_HEAD.match(body, 0, limit)
            if head is None:
                return
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return
            if name not in self.known:
                return
            self.streamed = _StreamedCall(new_call_id(), name, head.end())
            out.append(ToolCallStart(self.streamed.id, name))
        fragment = self.streamed.scan(body, limit)
        if fragment:
            out.append(ToolCallArguments(fragment))

    def feed(self, text: str, final: bool) -> list[ParsedPiece]:
        self.pending += text
        out: list[ParsedPiece] = []
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
            body = self.pending if end < 0 else self.pending[:end]
            closed = end >= 0 or final
            self._stream(body, len(body) if closed else len(body) - _partial_suffix(body, TOOL_CALL_CLOSE), out)
            if not closed:
                break
            call = self.streamed.call(body) if self.streamed is not None else self._parse(body)
            self.streamed = None
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
    def constraint(cls, functions: Sequence[Mapping[str, Any]], max_calls: int) -> StructuredOutput:
        schema = {**calls_schema(functions), "x-guidance": COMPACT_JSON}
        call = f'"{TOOL_CALL_OPEN}\\n" call_json "\\n{TOOL_CALL_CLOSE}"'
        more = max(0, max_calls - 1)  # call ("\n" call ("\n" call)?)?: at most max_calls
        start = "start: call" + ' ("\\n" call' * more + ")?" * more
        return StructuredOutput.lark(f"{start}\ncall: {call}\ncall_json: %json {json.dumps(schema)}\n")


class JsonToolParser(ToolParser):
    """A reply that is one JSON call object, or a list of them; anything else is text."""

    name = "json"

    def __init__(self, tools: Sequence[Mapping[str, Any]]):
        super().__init__(tools)
        self.pending = ""
        self.mode: str | None = None  # None until the first non-space character: "json" or "text"

    def feed(self, text: str, final: bool) -> list[ParsedPiece]:
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
    def constraint(cls, functions: Sequence[Mapping[str, Any]], max_calls: int) -> StructuredOutput:
        if max_calls <= 1:
            return StructuredOutput.json_schema(calls_schema(functions))
        return StructuredOutput.json_schema({"type": "array", "items": calls_schema(functions), "minItems": 1,
                                             "maxItems": max_calls})


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
