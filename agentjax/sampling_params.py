"""`SamplingParams`: how one request samples and when it stops.

Host only: never imports jax. Validation happens here, so bad values fail before they reach a
batch, with messages that name the value and the allowed range.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agentjax.errors import InvalidRequestError
from agentjax.structured.spec import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (temperature 0 is greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Constrain the output to a JSON schema, any JSON object, a Lark grammar or a regex.
    structured: StructuredOutput | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise InvalidRequestError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
