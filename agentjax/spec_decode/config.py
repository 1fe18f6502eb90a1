"""`SpeculativeConfig`: vLLM's `speculative_config` dict, checked once at start-up.

`{"method": "ngram" | "mtp" | "draft_model", "num_speculative_tokens": k, ...}` with
`prompt_lookup_min` / `prompt_lookup_max` for n-gram and `model` for a draft model. A bad value is a
`SpeculativeConfigError` that names it and the allowed range; nothing here runs a model. Host only:
never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from agentjax.errors import SpeculativeConfigError
from agentjax.json_setting import json_setting

METHODS = ("ngram", "mtp", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's n-gram defaults: both bounds 5 when neither is given, else the one given for the other.
DEFAULT_PROMPT_LOOKUP = 5
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculative-decoding method and its settings (field names are vLLM's)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"speculative_config num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]; got {k!r}")
        if self.method == "ngram":
            self._check_lookup()
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise SpeculativeConfigError(
                f"prompt_lookup_min and prompt_lookup_max belong to method 'ngram', not {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise SpeculativeConfigError("speculative_config method 'draft_model' needs 'model': the draft model's "
                                         "spec (a path, preset:NAME or embedded name) sharing the target's tokenizer")
        if self.method != "draft_model" and self.model is not None:
            raise SpeculativeConfigError(f"'model' belongs to method 'draft_model', not {self.method!r}")

    def _check_lookup(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_PROMPT_LOOKUP):
                raise SpeculativeConfigError(
                    f"speculative_config {name} must be an integer in [1, {MAX_PROMPT_LOOKUP}]; got {value!r}")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise SpeculativeConfigError(
                f"speculative_config prompt_lookup_min={low} is larger than prompt_lookup_max={high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict, its JSON text, a `SpeculativeConfig` or None (speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_setting(value, "speculative_config", SpeculativeConfigError,
                             example='{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise SpeculativeConfigError(f"speculative_config needs {key!r}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
