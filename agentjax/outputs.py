"""What a finished request hands back: `RequestOutput` and its samples (`CompletionOutput`).

The engine's callers build them (`LLM.generate`, the processes that follow a multi-process run), so they live
here, below every one of them; `from agentjax import RequestOutput` and `from agentjax.llm import ...` give
the same classes. Plain data: never imports the engine or jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agentjax.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One sample of a request: its text and ids, why it stopped, and its log probabilities when asked
    (`cumulative_logprob` is their sum; with best_of it is how samples were ranked)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One finished request: generated text and ids, and how much of its prompt was cached.

    `outputs` holds every returned sample (n of them); the flat fields are the first sample's.
    `prompt_logprobs` has one entry per prompt token (the first None) when asked for."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
