"""Statistics of a stream of sessions: the hit rate of a prefix cache that never evicts, and the
figures quoted in shared/traces/README.md and MISSION.md. Host only, like `traces`."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentjax.bench.traces import (
    GOLDEN_GAMMA,
    MIX_MULTIPLIER_1,
    Session,
    iter_all_sessions,
    iter_turns_in_time_order,
    splitmix64,
    stable_key,
)
from agentjax.errors import InvalidRequestError

# ---------------------------------------------------------------- a cache that never evicts

def _prefix_keys(scope_key: int, hash_ids: np.ndarray, start: int = 0,
                 start_key: int = 0) -> np.ndarray:
    """Key i names the block prefix hash_ids[:i+1] at its positions (a wrapping sum of mixes);
    computes keys from `start` on, given the key of hash_ids[:start] (0 for the empty prefix)."""
    # Two odd multipliers keep (id, position) pairs apart before the mix.
    positions = np.arange(start, len(hash_ids), dtype=np.uint64) * MIX_MULTIPLIER_1
    mixed = splitmix64((hash_ids[start:].astype(np.uint64) + np.uint64(scope_key))
                       * GOLDEN_GAMMA + positions)
    mixed[:1] += np.uint64(start_key)
    return np.cumsum(mixed, dtype=np.uint64)


def _view_base(hash_ids: np.ndarray) -> np.ndarray | None:
    """The 1-D array `hash_ids` is a leading slice of, if any (the generator's turns are)."""
    base = hash_ids.base
    if (isinstance(base, np.ndarray) and base.ndim == 1 and len(hash_ids)
            and base.dtype == hash_ids.dtype and base.strides == hash_ids.strides
            and np.may_share_memory(base[:1], hash_ids[:1])):  # one first element: same start
        return base
    return None


class _PrefixKeyMemo:
    """Prefix keys of a session's previous turn, reused for the ids a new turn shares with it."""

    def __init__(self, scope_key: int) -> None:
        self.scope_key = scope_key
        self.hash_ids = np.zeros(0, dtype=np.int64)
        self.keys = np.zeros(0, dtype=np.uint64)
        self.base: np.ndarray | None = None  # the id array the previous turn was a slice of

    def keys_for(self, hash_ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(prefix keys of hash_ids, how many leading ones the previous turn had too)."""
        common = min(len(hash_ids), len(self.hash_ids))
        base = _view_base(hash_ids)
        if base is not None:
            if base is not self.base:
                shared = 0  # the generator's subagents start a new id array
                self.base, self.base_keys = base, _prefix_keys(self.scope_key, base)
            else:
                shared = common  # both turns slice one id array from its start
            self.hash_ids, self.keys = hash_ids, self.base_keys[:len(hash_ids)]
            return self.keys, shared
        mismatches = np.flatnonzero(hash_ids[:common] != self.hash_ids[:common])
        shared = int(mismatches[0]) if len(mismatches) else common
        start_key = int(self.keys[shared - 1]) if shared else 0
        self.keys = np.concatenate([self.keys[:shared], _prefix_keys(
            self.scope_key, hash_ids, shared, start_key)])
        self.hash_ids, self.base = hash_ids, None
        return self.keys, shared


def infinite_cache_hit_rate(sessions: Sequence[Session]) -> float:
    """Share of input tokens a prefix cache that never evicts would serve: per request, the
    longest prefix of whole blocks seen before (in its hash scope), replayed in time order."""
    roots_left_per_scope = Counter(session.hash_scope for session in sessions)
    seen_per_scope: dict[str, set[int]] = {}
    hit_tokens = 0
    input_tokens = 0
    for root in sessions:
        memos: dict[int, _PrefixKeyMemo] = {}
        for session, turn, _ in iter_turns_in_time_order(root):
            seen = seen_per_scope.setdefault(session.hash_scope, set())
            memo = memos.get(id(session))
            if memo is None:
                memo = memos[id(session)] = _PrefixKeyMemo(stable_key(session.hash_scope))
            keys, shared_with_previous_turn = memo.keys_for(turn.hash_ids)
            # Every prefix of a seen prefix was seen too, so the hits are a binary search away;
            # the previous turn of this session left all its prefixes in the cache.
            low, high = shared_with_previous_turn, len(keys)
            if low < high and int(keys[low]) not in seen:
                high = low  # the usual case: the first block past the previous turn is new
            while low < high:
                middle = (low + high + 1) // 2
                if int(keys[middle - 1]) in seen:
                    low = middle
                else:
                    high = middle - 1
            hit_tokens += min(low * session.block_size, turn.input_tokens)
            input_tokens += turn.input_tokens
            seen.update(keys[low:].tolist())
        roots_left_per_scope[root.hash_scope] -= 1
        if roots_left_per_scope[root.hash_scope] == 0:  # a scope no later root can hit
            seen_per_scope.pop(root.hash_scope, None)
    return hit_tokens / input_tokens if input_tokens else 0.0


# ---------------------------------------------------------------- statistics of a stream

@dataclass(frozen=True)
class TraceStatistics:
    """The figures quoted in shared/traces/README.md and MISSION.md, for any loaded stream."""

    num_sessions: int
    num_requests: int  # every turn, subagents' included
    main_turns_median: float  # turns of root sessions
    main_turns_p90: float  # the 90% order statistic, sorted[int(0.9 n)]
    input_tokens_median: float  # over every request
    input_tokens_mean: float
    input_tokens_p90: float
    input_tokens_max: int
    output_tokens_median: float
    output_tokens_mean: float
    first_turn_input_median: float
    last_turn_input_median: float
    think_time_median_s: float  # over every request (a first turn's is 0)
    subagent_session_share: float  # root sessions with at least one subagent
    subagents_per_spawning_session_median: float
    infinite_cache_hit_rate: float


def describe_sessions(sessions: Sequence[Session]) -> TraceStatistics:
    roots = [session for session in sessions if session.turns]
    if not roots:
        raise InvalidRequestError("no sessions with turns to describe")
    all_turns = [turn for session in iter_all_sessions(roots) for turn in session.turns]
    inputs = np.array([turn.input_tokens for turn in all_turns])
    outputs = np.array([turn.output_tokens for turn in all_turns])
    main_turns = sorted(len(session.turns) for session in roots)
    spawning = [len(session.subagents) for session in roots if session.subagents]
    return TraceStatistics(
        num_sessions=len(roots),
        num_requests=len(all_turns),
        main_turns_median=float(np.median(main_turns)),
        main_turns_p90=float(main_turns[math.floor(0.9 * len(main_turns))]),
        input_tokens_median=float(np.median(inputs)),
        input_tokens_mean=float(inputs.mean()),
        input_tokens_p90=float(np.percentile(inputs, 90)),
        input_tokens_max=int(inputs.max()),
        output_tokens_median=float(np.median(outputs)),
        output_tokens_mean=float(outputs.mean()),
        first_turn_input_median=float(np.median([s.turns[0].input_tokens for s in roots])),
        last_turn_input_median=float(np.median([s.turns[-1].input_tokens for s in roots])),
        think_time_median_s=float(np.median([turn.think_time_s for turn in all_turns])),
        subagent_session_share=len(spawning) / len(roots),
        subagents_per_spawning_session_median=float(np.median(spawning)) if spawning else 0.0,
        infinite_cache_hit_rate=infinite_cache_hit_rate(roots))
