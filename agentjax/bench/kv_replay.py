"""The request stream `agentjax bench kv-sim` replays: agent traces laid out on lanes on a virtual clock,
with the agent hints a harness would send, plus the offline facts (next uses) only Belady may read.

The model (issue 14): sessions (trace files sorted by name) go round robin to `lanes` lanes; lane l
starts at l x `stagger_s`; a lane runs its sessions back to back (the next starts when the last
request of the previous one, subagents' included, has finished: its recorded `t` + `api_time`);
a request arrives at its session's start plus its recorded `t`; subagents run beside their parent
from their own `t`. Blocks are the traces' 64-token hash ids, salted per replayed session. Hints: a
request's `expected_next_turn_s` is the recorded gap to its session's next request times a
lognormal factor (sigma `hint_sigma`, seeded); a session's last request carries `session_end`,
and the parent turn a subagent forks after carries `branch_point`. Host only: never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentjax.bench.traces import Session, iter_all_sessions, iter_turns_in_time_order
from agentjax.errors import InvalidRequestError

NEVER = math.inf  # the next use of a block no later request reads


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay, in arrival order."""

    arrival_s: float
    session_index: int  # which replayed root session (its salt): 0..num_sessions-1
    session_id: str  # the root or subagent session this turn belongs to (unique in the replay)
    parent_session_id: str | None
    hash_ids: np.ndarray  # int64, one per full block of the prompt
    input_tokens: int
    expected_next_turn_s: float | None  # the hint (None on a session's last request)
    session_end: bool
    branch_point: bool


@dataclass
class Replay:
    """The requests in arrival order, and the layout they came from."""

    requests: list[ReplayRequest]
    block_tokens: int
    num_sessions: int
    lanes: int
    stagger_s: float
    session_starts_s: list[float]

    @property
    def input_tokens(self) -> int:
        return sum(request.input_tokens for request in self.requests)

    def block_keys(self, request: ReplayRequest) -> np.ndarray:
        """int64 names of the request's blocks, equal only within one replayed session."""
        return (np.int64(request.session_index) << np.int64(32)) | request.hash_ids


def build_replay(sessions: Sequence[Session], lanes: int, stagger_s: float = 10.0,
                 hint_sigma: float = 0.5, seed: int = 0) -> Replay:
    """Lay `sessions` (in the given order, e.g. trace files sorted by name) out on `lanes` lanes."""
    if lanes < 1:
        raise InvalidRequestError(f"lanes must be >= 1, got {lanes}")
    if not stagger_s >= 0 or not hint_sigma >= 0:
        raise InvalidRequestError(f"stagger_s={stagger_s} and hint_sigma={hint_sigma} must be >= 0")
    block_sizes = {session.block_size for session in sessions}
    if len(block_sizes) > 1:
        raise InvalidRequestError(f"sessions mix block sizes {sorted(block_sizes)}; replay one block size")
    factors = _hint_factors(sessions, hint_sigma, seed)
    lane_clock = [lane * stagger_s for lane in range(lanes)]
    starts, entries = [], []
    for index, root in enumerate(sessions):
        lane = index % lanes
        start = lane_clock[lane]
        starts.append(start)
        timeline = list(iter_turns_in_time_order(root))
        end = max((offset + (turn.recorded_api_time_s or 0.0) for _, turn, offset in timeline), default=0.0)
        lane_clock[lane] = start + end
        forks = {(id(node), sub.fork_turn) for node in iter_all_sessions([root]) for sub in node.subagents}
        for order, (node, turn, offset) in enumerate(timeline):
            if len(turn.hash_ids) and not (turn.hash_ids.min() >= 0 and turn.hash_ids.max() < 2**32):
                raise InvalidRequestError(f"session {node.session_id} turn {turn.index}: hash ids must lie in "
                                          f"[0, 2**32), got [{turn.hash_ids.min()}, {turn.hash_ids.max()}]")
            following = node.turns[turn.index + 1] if turn.index + 1 < len(node.turns) else None
            expected = None
            if following is not None:
                gap = max(0.0, following.offset_s - turn.offset_s)
                expected = gap * factors[(index, node.session_id, turn.index)]
            request = ReplayRequest(
                arrival_s=start + offset, session_index=index, session_id=f"{index}:{node.session_id}",
                parent_session_id=None if node.parent_id is None else f"{index}:{node.parent_id}",
                hash_ids=np.asarray(turn.hash_ids, dtype=np.int64), input_tokens=turn.input_tokens,
                expected_next_turn_s=expected, session_end=following is None,
                branch_point=(id(node), turn.index) in forks)
            entries.append((start + offset, index, order, request))
    entries.sort(key=lambda entry: entry[:3])
    block_tokens = block_sizes.pop() if block_sizes else 64
    return Replay([entry[3] for entry in entries], block_tokens, len(sessions), lanes, stagger_s, starts)


def _hint_factors(sessions: Sequence[Session], sigma: float, seed: int) -> dict:
    """One lognormal factor per turn, drawn in session order (independent of the lane count)."""
    rng = np.random.default_rng(seed)
    factors = {}
    for index, root in enumerate(sessions):
        for node in iter_all_sessions([root]):
            draws = rng.lognormal(0.0, sigma, len(node.turns)) if sigma > 0 else np.ones(len(node.turns))
            for turn, factor in zip(node.turns, draws.tolist()):
                factors[(index, node.session_id, turn.index)] = factor
    return factors


def next_uses(replay: Replay) -> list[np.ndarray]:
    """Per request, per block: the index of the next request that reads the block (NEVER: none).
    Offline knowledge, for Belady only. One sort over every block of the replay."""
    lengths = np.asarray([len(request.hash_ids) for request in replay.requests], dtype=np.int64)
    if lengths.sum() == 0:
        return [np.zeros(0) for _ in replay.requests]
    keys = np.concatenate([replay.block_keys(request) for request in replay.requests])
    request_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    order = np.lexsort((request_index, keys))
    del request_index
    sorted_keys = keys[order]
    del keys
    following = np.full(len(order), NEVER)
    same = sorted_keys[1:] == sorted_keys[:-1]
    del sorted_keys
    later = np.repeat(np.arange(len(lengths), dtype=np.float64), lengths)[order[1:]]
    following[order[:-1]] = np.where(same, later, NEVER)
    return np.split(following, np.cumsum(lengths)[:-1])


def infinite_cache_hits(replay: Replay) -> np.ndarray:
    """Per request, the blocks a cache that never evicts would serve (its longest seen prefix)."""
    seen: set[int] = set()
    hits = np.zeros(len(replay.requests), dtype=np.int64)
    for i, request in enumerate(replay.requests):
        keys = replay.block_keys(request).tolist()
        low, high = 0, len(keys)
        while low < high:  # every prefix of a seen prefix was seen: binary search
            middle = (low + high + 1) // 2
            if keys[middle - 1] in seen:
                low = middle
            else:
                high = middle - 1
        hits[i] = low
        seen.update(keys[low:])
    return hits
