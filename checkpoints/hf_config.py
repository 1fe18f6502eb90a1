"""Typed reading of an HF config.json, so a missing or invalid field is an error that names it.

`ConfigFields` wraps the parsed JSON (or a nested section such as `text_config`); each getter
checks the field's type and range and raises `ModelConfigError` naming the field, what was found
and what is allowed. `rope_settings` reads RoPE as transformers 5 writes it (`rope_parameters`)
and as older configs did (`rope_theta` plus `rope_scaling`). Host only: never imports jax.
"""
from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from typing import Any

from agentjax.config import RopeScaling
from agentjax.errors import ModelConfigError

_MISSING = object()


class ConfigFields:
    """Checked access to one config object; `source` and `prefix` name it in messages."""

    def __init__(self, raw: Mapping[str, Any], source: str = "config.json", prefix: str = ""):
        self.raw = raw
        self.source = source
        self.prefix = prefix

    def path(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def error(self, key: str, found: Any, allowed: str) -> ModelConfigError:
        what = "is missing" if found is _MISSING else f"is {found!r}"
        return ModelConfigError(f"{self.source}: field {self.path(key)!r} {what}; expected {allowed}")

    def _value(self, key: str, default: Any, allowed: str) -> Any:
        value = self.raw.get(key, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.error(key, _MISSING, allowed)
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int | None = 1) -> Any:
        """An int >= `minimum` (None: any int); `default` when absent (required when not given)."""
        allowed = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        value = self._value(key, default, allowed)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            raise self.error(key, value, allowed)
        return value

    def number(self, key: str, default: Any = _MISSING, *, positive: bool = True) -> Any:
        """A float (> 0 when `positive`); ints are accepted."""
        allowed = "a number" + (" > 0" if positive else "")
        value = self._value(key, default, allowed)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
            raise self.error(key, value, allowed)
        return float(value)

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        value = self._value(key, default, "true or false")
        if not isinstance(value, bool) and value is not default:
            raise self.error(key, value, "true or false")
        return value

    def choice(self, key: str, allowed: Iterable[Any], default: Any = _MISSING) -> Any:
        """One of `allowed` (a string field such as hidden_act)."""
        allowed = tuple(allowed)
        text = "one of " + ", ".join(repr(a) for a in allowed)
        value = self._value(key, default, text)
        if value not in allowed:
            raise self.error(key, value, text)
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An optional token id or list of them (eos_token_id) as a tuple."""
        value = self.raw.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise self.error(key, value, "a token id >= 0 or a list of them")
        return tuple(values)

    def string_list(self, key: str, allowed: Iterable[str], length: int, default: Any = _MISSING) -> Any:
        """A list of `length` strings, each one of `allowed` (layer_types)."""
        allowed = tuple(allowed)
        text = f"a list of {length} entries, each one of {', '.join(repr(a) for a in allowed)}"
        value = self._value(key, default, text)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or len(value) != length or any(v not in allowed for v in value):
            raise self.error(key, value, text)
        return tuple(value)

    def section(self, key: str) -> "ConfigFields":
        """A nested object (a wrapper's `text_config`) with its own checked fields."""
        value = self._value(key, _MISSING, "a JSON object")
        if not isinstance(value, Mapping):
            raise self.error(key, value, "a JSON object")
        return ConfigFields(value, self.source, prefix=f"{self.path(key)}.")

    def reject(self, key: str, allowed: str, *, unless: Any = None) -> None:
        """Fail when a field the loader cannot honour is set (to anything but `unless`)."""
        value = self.raw.get(key)
        if value is not None and value != unless and value is not False:
            raise self.error(key, value, allowed)


def _rope_scaling(fields: ConfigFields, key: str, raw: Mapping[str, Any]) -> RopeScaling | None:
    params = ConfigFields(raw, fields.source, prefix=f"{fields.path(key)}.")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=params.number("factor"))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=params.number("factor"),
            low_freq_factor=params.number("low_freq_factor", 1.0),
            high_freq_factor=params.number("high_freq_factor", 4.0),
            original_max_position_embeddings=params.integer("original_max_position_embeddings", 8192),
        )
    if kind == "yarn":
        return _yarn(params, raw)
    raise params.error("rope_type", kind, "one of 'default', 'linear', 'llama3', 'yarn'")


def _yarn(params: ConfigFields, raw: Mapping[str, Any]) -> RopeScaling:
    """YaRN as transformers' `_compute_yarn_parameters` reads it: the cos/sin factor is `attention_factor`,
    else `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set, else
    `0.1 ln(factor) + 1` (left None here: agentjax derives it the same way)."""
    factor = params.number("factor")
    attention_factor = raw.get("attention_factor")
    mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        def scaled(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        attention_factor = scaled(mscale) / scaled(mscale_all_dim)
    return RopeScaling(
        kind="yarn", factor=factor,
        original_max_position_embeddings=params.integer("original_max_position_embeddings"),
        beta_fast=float(raw.get("beta_fast") or 32.0), beta_slow=float(raw.get("beta_slow") or 1.0),
        attention_factor=None if attention_factor is None else params.number("attention_factor", attention_factor),
        truncate=params.boolean("truncate", True),
    )


def rope_settings(fields: ConfigFields, layer_type: str | None = None,
                  default_theta: float = 10_000.0) -> tuple[float, RopeScaling | None]:
    """`(theta, scaling)` from `rope_parameters` (keyed by layer type when `layer_type` is given
    and the config keys it so) or from the legacy `rope_theta` / `rope_scaling` fields."""
    if fields.has("rope_parameters"):
        key, raw = "rope_parameters", fields.raw["rope_parameters"]
        if not isinstance(raw, Mapping):
            raise fields.error(key, raw, "a JSON object")
        if layer_type is not None and isinstance(raw.get(layer_type), Mapping):
            key, raw = f"rope_parameters.{layer_type}", raw[layer_type]
        params = ConfigFields(raw, fields.source, prefix=f"{fields.path(key)}.")
        return params.number("rope_theta", default_theta), _rope_scaling(fields, key, raw)
    theta = fields.number("rope_theta", default_theta)
    scaling = fields.raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise fields.error("rope_scaling", scaling, "a JSON object or null")
    return theta, _rope_scaling(fields, "rope_scaling", scaling or {})
