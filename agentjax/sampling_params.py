"""`SamplingParams`: how one request samples, what it reports, and when it stops.

Host only: never imports jax. Validation happens here, so bad values fail before they reach a
batch, with messages that name the value and the allowed range. Penalties, logit bias and log
probabilities follow vLLM's names, ranges and formulas; `n` parallel samples (or the best `n` of
`best_of`) each draw from their own seed stream, `sample_seed(seed, index)`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from agentjax.errors import InvalidRequestError
from agentjax.structured.spec import StructuredOutput

# Most top log probabilities one token may report (vLLM's default `max_logprobs`); the device
# always computes this many when any row asks, so a request's k never recompiles the step.
MAX_LOGPROBS = 20
MAX_PARALLEL_SAMPLES = 128
MAX_LOGIT_BIAS_ENTRIES = 1024


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of parallel sample `index` of a request seeded with `seed`: sample 0 keeps it, the
    others get distinct seeds derived from it (the same on every run); None stays None."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


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
    # Parallel samples of one prompt (its pages computed once); best_of > n keeps the n samples
    # with the highest cumulative log probability.
    n: int = 1
    best_of: int | None = None
    # vLLM's penalties, applied on the device in its order: logit_bias (token id -> added value),
    # then repetition (prompt and output tokens), frequency and presence (output tokens).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    # Log probabilities: of each sampled token plus its `logprobs` most likely alternatives, and of
    # each prompt token plus `prompt_logprobs` alternatives (None: not reported).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
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
        self._check_parallel_and_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    def _check_parallel_and_penalties(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_PARALLEL_SAMPLES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_PARALLEL_SAMPLES}], got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= MAX_PARALLEL_SAMPLES):
            raise InvalidRequestError(
                f"best_of must be an integer in [n={self.n}, {MAX_PARALLEL_SAMPLES}], got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise InvalidRequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, "
                                          f"got {len(self.logit_bias)}")
            bias = {}
            for token, value in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not -100.0 <= float(value) <= 100.0:
                    raise InvalidRequestError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
                bias[token] = float(value)
            object.__setattr__(self, "logit_bias", bias)
        else:
            object.__setattr__(self, "logit_bias", None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """How many samples run: `best_of` if set, else `n`."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty or logit bias changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def for_sample(self, index: int) -> "SamplingParams":
        """These settings for parallel sample `index`: one sample, its own seed (`sample_seed`)."""
        seed = sample_seed(self.seed, index)
        if self.n == 1 and self.best_of is None and seed == self.seed:
            return self
        return replace(self, n=1, best_of=None, seed=seed)
