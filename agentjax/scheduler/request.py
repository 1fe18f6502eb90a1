"""Requests and sessions as the scheduler sees them, plus the agent hints that steer both.

Host only: never imports jax. A `Request` is one turn's prompt plus what has been computed and
generated for it; a `Session` groups a conversation's turns.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from agentjax.errors import InvalidRequestError
from agentjax.logprobs import TokenLogprobs
from agentjax.sampling_params import SamplingParams

PinMode = Literal["none", "soft", "session"]

# How long a finished turn's pages stay soft-pinned when no hint says otherwise: long enough
# for a typical tool call (the traces' median think time is 9 s), short enough not to hoard.
DEFAULT_SESSION_TTL_S = 30.0


@dataclass(frozen=True)
class AgentHints:
    """What an agent harness tells the server about its session (all optional).

    - `expected_next_turn_s`: expected tool-call time before the next turn; sets the pin TTL.
    - `branch_point`: subagents will fork from the end of this prompt; its pages stay pinned
      until the session ends.
    - `pin`: "none" (no pin), "soft" (pin for the TTL), "session" (pin until `session_end`).
    - `session_end`: this is the last turn; release the session's pins when it finishes.
    """

    session_id: str | None = None
    parent_session_id: str | None = None
    turn: int | None = None
    expected_next_turn_s: float | None = None
    branch_point: bool = False
    priority: int | None = None
    pin: PinMode = "soft"
    session_end: bool = False

    def __post_init__(self) -> None:
        if self.expected_next_turn_s is not None and not 0 <= self.expected_next_turn_s <= 86_400:
            raise InvalidRequestError(
                f"agent_hints.expected_next_turn_s must be in [0, 86400] seconds, got {self.expected_next_turn_s}"
            )
        if self.pin not in ("none", "soft", "session"):
            raise InvalidRequestError(f"agent_hints.pin must be 'none', 'soft' or 'session', got {self.pin!r}")
        if self.turn is not None and self.turn < 0:
            raise InvalidRequestError(f"agent_hints.turn must be >= 0, got {self.turn}")


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One turn: its prompt, sampling settings, and progress."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    session_id: str | None = None
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling
    hints: AgentHints | None = None
    cache_salt: str | None = None
    seed: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # -1 until the first admission looks up the prefix cache
    matcher: Any = None  # structured output: the grammar matcher of this request's output
    # Prefixes the client marked for reuse, as (num_tokens, ttl_s): pinned when the turn ends.
    pin_prefixes: tuple[tuple[int, float], ...] = ()
    num_preemptions: int = 0
    # Speculative decoding may add draft tokens to this request's decode rows (off for penalised requests:
    # their penalties would have to count each draft as an output).
    allow_drafts: bool = True
    finish_reason: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without copying the whole sequence (a step's row)."""
        prompt_len = len(self.prompt_token_ids)
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(eq=False)
class Session:
    """A conversation's turns (its pages' pins are the KV policy's: agentjax.scheduler.sessions)."""

    session_id: str
    parent_session_id: str | None = None
    request_ids: list[str] = field(default_factory=list)
    last_activity: float = field(default_factory=time.monotonic)
    pinned_until_end: bool = False  # its last turn asked for pin "session"
    ended: bool = False


@dataclass(frozen=True)
class EngineOutput:
    """What one engine step produced for one request: its new tokens and, when done, why it stopped."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_prompt_tokens: int
    # Per new token, when the request asked for log probabilities (`SamplingParams.logprobs`).
    logprobs: list[TokenLogprobs] | None = None
    # With a request's first output, when it asked for `prompt_logprobs`: one entry per prompt token
    # (the first None, as nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
