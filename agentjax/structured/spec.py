"""`StructuredOutput`: the constraint one request's output must satisfy.

Host only: imports neither jax nor the grammar library, so request validation stays cheap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from agentjax.errors import InvalidRequestError
from agentjax.json_setting import json_setting

StructuredKind = Literal["json_schema", "json_object", "lark", "regex"]

# JSON in the spacing `json.dumps` writes by default: what a chat model has seen most and what
# the tool parsers read back. Without this the grammar lets any whitespace through, and a small
# model can wander off into blank lines.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint. `value` is the schema (JSON text) for json_schema, the grammar or regex text
    for lark and regex, and unused for json_object (any JSON object)."""

    kind: StructuredKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "lark", "regex"):
            raise InvalidRequestError(f"structured output kind must be json_schema, json_object, lark or regex; "
                                      f"got {self.kind!r}")
        if self.kind != "json_object" and not self.value:
            raise InvalidRequestError(f"a {self.kind} constraint needs its {self.kind} text")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        schema = json_setting(schema, "the JSON schema")
        return cls("json_schema", json.dumps(schema))  # key order kept: it is the property order

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with llguidance's options for compact JSON (kept if the schema sets its own)."""
    options = {**COMPACT_JSON, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}
