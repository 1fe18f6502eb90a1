"""Agent traffic the recorded traces lack, added to a loaded stream: subagents, retries, compactions.

`augment_sessions` gives root sessions subagent rollouts that branch off the parent's system prompt and
tools, identical re-sends of some requests, and one compaction that rewrites the context's tail into a
summary. Each is seeded by (seed, session id, feature), so one feature's draws never move another's.
Works on unscaled sessions (scale them afterwards). Host only: never imports jax.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from agentjax.bench.generate import LogNormal, SessionGeneratorConfig, grow_turns, make_turns
from agentjax.bench.traces import Session, Turn, iter_all_sessions, stable_key
from agentjax.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_SUBAGENTS, _RETRIES, _COMPACTION = 1, 2, 3  # per-feature streams of a session's random numbers


@dataclass(frozen=True)
class TraceAugmentConfig:
    """What to add. Off by default; the reference agent mix is `subagent_share=0.44` (a median of 4
    rollouts each), a few percent of requests retried, and one compaction per session.
    `generator` gives a rollout's turns, task prompt, outputs, tool results and think times."""

    seed: int = 0
    subagent_share: float = 0.0  # of root sessions that spawn rollouts
    rollouts: LogNormal = LogNormal(4, 0.5)  # rollouts per spawning session
    retry_rate: float = 0.0  # of requests re-sent once, identically
    compaction: bool = False  # one compaction per root session with at least 3 main turns
    summary_tokens: LogNormal = LogNormal(2_000, 0.5)  # the summary that replaces the tail
    generator: SessionGeneratorConfig = SessionGeneratorConfig()

    def __post_init__(self) -> None:
        if not (0.0 <= self.subagent_share <= 1.0 and 0.0 <= self.retry_rate <= 1.0):
            raise InvalidRequestError(
                f"subagent_share={self.subagent_share} and retry_rate={self.retry_rate} must lie in [0, 1]")

    @property
    def active(self) -> bool:
        return self.subagent_share > 0 or self.retry_rate > 0 or self.compaction


def _rng(config: TraceAugmentConfig, session: Session, feature: int) -> np.random.Generator:
    return np.random.default_rng([config.seed, stable_key(session.session_id), feature])


def _common_blocks(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading hash ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def head_blocks(session: Session, turn: Turn) -> int:
    """The whole blocks of the system prompt and tools that `turn` shares with the session's first
    turn: `session.head_tokens` where the trace gives it, else the first turn's whole context."""
    first = session.turns[0].hash_ids
    wanted = session.head_tokens // session.block_size if session.head_tokens else len(first)
    return min(wanted, _common_blocks(first, turn.hash_ids))


def _max_hash_id(session: Session) -> int:
    return max((int(turn.hash_ids.max()) for node in iter_all_sessions([session])
                for turn in node.turns if len(turn.hash_ids)), default=0)


def add_compaction(session: Session, rng: np.random.Generator, summary_tokens: LogNormal,
                   next_id: int) -> int:
    """After a main turn c in the second half, the turns that still carry c's context get that context
    (past the head) replaced by fresh summary blocks; what they add after c follows the summary.
    Returns the next free hash id. Sessions under 3 turns are left as they are."""
    turns = session.turns
    if len(turns) < 3:
        return next_id
    c = int(rng.integers(len(turns) // 2, len(turns) - 1))
    block = session.block_size
    head = head_blocks(session, turns[c])
    summary_blocks = max(1, int(summary_tokens.sample_counts(rng, 1)[0]) // block)
    summary = np.arange(next_id, next_id + summary_blocks, dtype=np.int64)
    context = turns[c].hash_ids
    first = True
    for t in range(c + 1, len(turns)):
        turn = turns[t]
        shared = _common_blocks(turn.hash_ids, context)
        if shared <= head + summary_blocks:  # nothing to compact (the trace compacted here itself)
            continue
        ids = np.concatenate([turn.hash_ids[:head], summary, turn.hash_ids[shared:]])
        removed = (shared - head - summary_blocks) * block
        turns[t] = replace(turn, hash_ids=ids, input_tokens=turn.input_tokens - removed, compacted=first)
        first = False
    return next_id + summary_blocks


def add_subagents(session: Session, rng: np.random.Generator, config: TraceAugmentConfig,
                  next_id: int) -> int:
    """With probability `subagent_share`, rollouts launched by one main turn: each starts from the
    parent's head (system prompt and tools), adds its own task, and grows on its own blocks from
    there (a branch). Returns the next free hash id."""
    if not session.turns or not rng.random() < config.subagent_share:
        return next_id
    generator, block = config.generator, session.block_size
    fork_turn = int(rng.integers(len(session.turns)))
    fork = session.turns[fork_turn]
    head = head_blocks(session, fork)
    num_rollouts = int(config.rollouts.sample_counts(rng, 1)[0])
    for rollout in range(num_rollouts):
        num_turns = int(generator.subagent_turns.sample_counts(rng, 1)[0])
        task = int(generator.subagent_task_tokens.sample_counts(rng, 1)[0])
        inputs, outputs, thinks = grow_turns(rng, generator, num_turns, head * block + task, 0.0)
        own = int(inputs[-1]) // block - head
        ids = np.concatenate([fork.hash_ids[:head], np.arange(next_id, next_id + own, dtype=np.int64)])
        next_id += own
        session.subagents.append(Session(
            f"{session.session_id}/rollout_{rollout}", make_turns(inputs, outputs, thinks, ids, block),
            block, session.hash_scope, parent_id=session.session_id, fork_turn=fork_turn,
            start_offset_s=fork.offset_s, head_tokens=head * block))
    return next_id


def add_retries(session: Session, rng: np.random.Generator, retry_rate: float) -> None:
    """Marks each turn of the session and its subagents for one identical re-send with probability
    `retry_rate`."""
    for node in iter_all_sessions([session]):
        draws = rng.random(len(node.turns))
        node.turns = [replace(turn, retries=1) if draw < retry_rate else turn
                      for turn, draw in zip(node.turns, draws)]


def augment_session(session: Session, config: TraceAugmentConfig) -> Session:
    """Adds `config`'s traffic to one unscaled root session, in place; returns it."""
    next_id = _max_hash_id(session) + 1
    if config.compaction:
        next_id = add_compaction(session, _rng(config, session, _COMPACTION), config.summary_tokens, next_id)
    if config.subagent_share > 0:
        next_id = add_subagents(session, _rng(config, session, _SUBAGENTS), config, next_id)
    if config.retry_rate > 0:
        add_retries(session, _rng(config, session, _RETRIES), config.retry_rate)
    return session


def augment_sessions(sessions: Sequence[Session], config: TraceAugmentConfig) -> list[Session]:
    """`augment_session` on every root session; the same config gives the same stream."""
    out = [augment_session(session, config) for session in sessions]
    if config.active:
        spawned = sum(1 for session in out if any(sub.session_id.endswith("/rollout_0")
                                                   for sub in session.subagents))
        logger.info("augmented %d sessions: %d spawn rollouts, retry rate %.3f, compaction %s",
                    len(out), spawned, config.retry_rate, config.compaction)
    return out
