"""Request parsing at the edge: every JSON body is decoded, parsed and checked once, before any handler.

A body must be UTF-8 (overlong forms, encoded surrogates and stray bytes are a 400 naming the byte
offset), valid JSON, and no string in it, key or value, may hold a lone surrogate (`"\\ud800"`, which
no encoder can write) or NUL: a 400 names the field, instead of a 500 from deep in the tokenizer.
`EdgeRoute` is the app's route class, so every route, present or future, parses this way. Never
imports jax.
"""
from __future__ import annotations

import email.message
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from agentjax.server.errors import APIError

# A `\u` escape of NUL or of a surrogate: only then can a parsed string hold either. A hit is checked
# string by string (it may be an escaped backslash before plain text, or a high surrogate escape
# followed by a low one, which is one valid character). A literal start keeps the scan at memchr speed.
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")
JSON_METHODS = frozenset({"POST", "PUT", "PATCH"})


class InvalidTextError(APIError):
    """A body that is not UTF-8 text, or a string in it that is not text."""


def parse_json_body(body: bytes) -> Any:
    """The parsed body; raises `InvalidTextError` (or `json.JSONDecodeError`, which the app turns into
    its invalid-JSON 400) for a body that is not JSON text."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = body[error.start:error.start + 4]
        raise InvalidTextError(f"the request body is not valid UTF-8: byte {error.start} starts {bad!r} "
                               f"({error.reason})", code="invalid_utf8") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidTextError(f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column "
                               f"{error.colno})", code="invalid_json") from None
    except (ValueError, RecursionError) as error:  # a number of over 4300 digits; nesting deeper than Python's limit
        raise InvalidTextError(f"the request body is not valid JSON here: {str(error)[:200]}",
                               code="invalid_json") from None
    if _SUSPECT_ESCAPE.search(body):
        check_text(value)
    return value


def check_text(value: Any) -> None:
    """Raises `InvalidTextError` naming the first string (or key) in `value` with NUL or a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            _check_string(item, path or "body")
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                _check_string(key, f"a key in {path or 'the body'}", path or None)
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{index}]") for index, child in reversed(list(enumerate(item))))


def _check_string(text: str, where: str, param: str | None = "") -> None:
    match = _BAD_CHAR.search(text)
    if match is None:
        return
    char = match.group()
    what = "a NUL character (U+0000)" if char == "\x00" else f"a lone surrogate (U+{ord(char):04X})"
    shown = where[:120] + ("..." if len(where) > 120 else "")
    raise InvalidTextError(f"{shown} holds {what} at character {match.start()}; text must be valid Unicode "
                           "without NUL", param=shown if param == "" else param, code="invalid_text")


def wants_json(request: Request) -> bool:
    """Whether FastAPI would parse this request's body as JSON (a JSON content type on a method with a body)."""
    if request.method not in JSON_METHODS:
        return False
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class ParsedRequest(Request):
    """A request whose body `EdgeRoute` has read and parsed: handlers get the checked value."""

    def __init__(self, request: Request, body: bytes, parsed: Any):
        super().__init__(request.scope, request.receive)
        self._edge_body = body
        self._edge_parsed = parsed

    async def body(self) -> bytes:
        return self._edge_body

    async def json(self) -> Any:
        return self._edge_parsed


class EdgeRoute(APIRoute):
    """The app's route class: JSON bodies are parsed by `parse_json_body` before FastAPI validates them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_then_handle(request: Request) -> Response:
            if wants_json(request):
                body = await request.body()
                if body:
                    request = ParsedRequest(request, body, parse_json_body(body))
            return await handler(request)

        return parse_then_handle
