"""Synthetic agent sessions whose defaults reproduce the mission's workload figures.

Each turn re-sends the growing context plus a short new prefill (the previous output and a tool
result); some sessions fork subagent rollouts from a parent prefix. Seeded and configurable; emits
the same `Session`/`Turn` stream as the trace loaders. Host only: never imports jax.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from agentjax.bench.traces import WEKA_BLOCK_SIZE, Session, Turn, scale_session
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogNormal:
    """A log-normal distribution given by its median and the sigma of its logarithm."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0):
            raise InvalidRequestError(
                f"LogNormal(median={self.median}, sigma={self.sigma}) needs median > 0, sigma >= 0")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.median * np.exp(self.sigma * rng.standard_normal(size))

    def sample_counts(self, rng: np.random.Generator, size: int, minimum: int = 1) -> np.ndarray:
        """Rounded samples, at least `minimum` (token counts, turn counts)."""
        return np.maximum(minimum, np.rint(self.sample(rng, size))).astype(np.int64)


@dataclass(frozen=True)
class SessionGeneratorConfig:
    """Every distribution of the generator. The defaults give the mission's medians: 43 main turns
    per session, 142K input and 444 output tokens per request, subagents in 44% of sessions with a
    median of 4 rollouts, and (from the dev traces) 9 s of think time between turns. Sessions
    too long to grow from `min_first_turn_input_tokens` to their middle context get shorter tool
    results (never shorter outputs)."""

    seed: int = 0
    main_turns: LogNormal = LogNormal(43, 0.9)
    # A session's middle turn carries this much context; its first turn starts lower by half the
    # session's growth, so the median main request of a session sits here. Subagents grow on top
    # of their fork point, so 134K here gives a 142K median over all requests, subagents included
    # (measured at 2,000 sessions, seeds 0 and 1: 143.0K and 142.2K).
    middle_turn_input_tokens: LogNormal = LogNormal(134_000, 0.45)
    min_first_turn_input_tokens: int = 8_000  # system prompt and tool definitions
    tool_result_tokens: LogNormal = LogNormal(1_000, 1.0)  # new prefill besides the last output
    output_tokens: LogNormal = LogNormal(444, 0.9)
    think_time_s: LogNormal = LogNormal(9.0, 1.2)
    subagent_session_share: float = 0.44
    rollouts_per_spawning_session: LogNormal = LogNormal(4, 0.5)
    subagent_turns: LogNormal = LogNormal(10, 0.6)
    subagent_task_tokens: LogNormal = LogNormal(600, 0.8)  # the instruction after the fork prefix
    block_size: int = WEKA_BLOCK_SIZE
    context_scale: float = 1.0
    session_id_prefix: str = "synthetic"

    def __post_init__(self) -> None:
        if not 0.0 <= self.subagent_session_share <= 1.0:
            raise InvalidRequestError(
                f"subagent_session_share={self.subagent_session_share} must lie in [0, 1]")
        if self.block_size < 1 or self.min_first_turn_input_tokens < 1:
            raise InvalidRequestError(
                f"block_size={self.block_size} and min_first_turn_input_tokens="
                f"{self.min_first_turn_input_tokens} must be >= 1")


def grow_turns(rng: np.random.Generator, config: SessionGeneratorConfig, num_turns: int,
                first_input_tokens: int | None, middle_input_tokens: float
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input, output, think time) per turn. Turn t re-sends turn t-1's context, its output and a
    tool result. Without a given first input, the first turn is placed so that the middle turn
    has `middle_input_tokens`; where the session is too long for that, its tool results shrink."""
    outputs = config.output_tokens.sample_counts(rng, num_turns)
    tool_results = config.tool_result_tokens.sample_counts(rng, num_turns, minimum=0)
    tool_results[0] = 0
    output_growth = np.concatenate([[0], np.cumsum(outputs[:-1])])
    tool_growth = np.cumsum(tool_results)
    if first_input_tokens is None:
        middle = num_turns // 2  # the median turn (the upper one for an even count)
        room = middle_input_tokens - config.min_first_turn_input_tokens - output_growth[middle]
        if tool_growth[middle] > max(room, 0):
            tool_results = np.floor(tool_results * max(room, 0) / tool_growth[middle])
            tool_growth = np.cumsum(tool_results.astype(np.int64))
        first_input_tokens = max(config.min_first_turn_input_tokens, int(
            middle_input_tokens - output_growth[middle] - tool_growth[middle]))
    think_times = config.think_time_s.sample(rng, num_turns)
    think_times[0] = 0.0
    inputs = first_input_tokens + output_growth + tool_growth
    return inputs.astype(np.int64), outputs, think_times


def make_turns(inputs: np.ndarray, outputs: np.ndarray, think_times: np.ndarray,
                block_ids: np.ndarray, block_size: int) -> list[Turn]:
    """Turns whose hash ids are views of one id array: block i keeps one id for the session."""
    offsets = np.cumsum(think_times)
    return [Turn(index=index, hash_ids=block_ids[:int(inputs[index]) // block_size],
                 input_tokens=int(inputs[index]), output_tokens=int(outputs[index]),
                 think_time_s=float(think_times[index]), offset_s=float(offsets[index]))
            for index in range(len(inputs))]


def generate_session(rng: np.random.Generator, config: SessionGeneratorConfig,
                     session_id: str) -> Session:
    """One root session and, with probability `subagent_session_share`, its rollouts, which all
    fork from the prompt of one parent turn (parallel subagents launched by that turn)."""
    block_size = config.block_size
    num_turns = int(config.main_turns.sample_counts(rng, 1)[0])
    middle_input = float(config.middle_turn_input_tokens.sample(rng, 1)[0])
    inputs, outputs, think_times = grow_turns(rng, config, num_turns, None, middle_input)
    scope = f"{config.session_id_prefix}:{config.seed}:{session_id}"
    num_parent_blocks = int(inputs[-1]) // block_size
    parent_ids = np.arange(1, num_parent_blocks + 1, dtype=np.int64)
    session = Session(session_id, make_turns(inputs, outputs, think_times, parent_ids, block_size),
                      block_size, scope)
    if rng.random() < config.subagent_session_share:
        next_block_id = num_parent_blocks + 1
        fork_turn = int(rng.integers(num_turns))
        fork = session.turns[fork_turn]
        num_rollouts = int(config.rollouts_per_spawning_session.sample_counts(rng, 1)[0])
        for rollout in range(num_rollouts):
            sub_turns = int(config.subagent_turns.sample_counts(rng, 1)[0])
            task_tokens = int(config.subagent_task_tokens.sample_counts(rng, 1)[0])
            sub_inputs, sub_outputs, sub_thinks = grow_turns(
                rng, config, sub_turns, fork.input_tokens + task_tokens, 0.0)
            shared = len(fork.hash_ids)
            own = int(sub_inputs[-1]) // block_size - shared
            sub_ids = np.concatenate([parent_ids[:shared], np.arange(
                next_block_id, next_block_id + own, dtype=np.int64)])
            next_block_id += own
            session.subagents.append(Session(
                f"{session_id}/rollout_{rollout}",
                make_turns(sub_inputs, sub_outputs, sub_thinks, sub_ids, block_size),
                block_size, scope, parent_id=session_id, fork_turn=fork_turn,
                start_offset_s=fork.offset_s))
    return scale_session(session, block_size, config.context_scale)


def generate_sessions(num_sessions: int,
                      config: SessionGeneratorConfig = SessionGeneratorConfig()) -> list[Session]:
    """`num_sessions` root sessions from `config.seed`: the same config gives the same stream."""
    if num_sessions < 0:
        raise InvalidRequestError(f"num_sessions={num_sessions} must be >= 0")
    rng = np.random.default_rng(config.seed)
    sessions = [generate_session(rng, config, f"{config.session_id_prefix}_{index:06d}")
                for index in range(num_sessions)]
    logger.info("generated %d synthetic sessions (seed %d)", num_sessions, config.seed)
    return sessions
