"""A setting given as a dict or as its JSON text (a command-line flag's value, or `LLM(...)`'s keyword):
the dict, or the caller's error class naming the setting. Host only: never imports jax."""
from __future__ import annotations

import json
from typing import Any

from agentjax.errors import InvalidRequestError


def json_setting(value: Any, name: str, error: type[Exception] = InvalidRequestError, example: str = "") -> dict:
    """`value` as a dict: a dict as it is, a string parsed as JSON; `error` names `name` (and, for a value
    that is no object, shows `example`) otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise error(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{name} must be a JSON object{' like ' + example if example else ''}; "
                    f"got {type(value).__name__}")
    return value
