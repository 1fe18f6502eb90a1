"""Retention policies (which of a turn's blocks a lower tier stores), the recompute cost model, and
the eviction score the tiers weigh against bytes when they choose a victim.

`IntervalRetention` stores the pages up to the end of the prompt at every turn; `MarconiRetention`
stores only what a second turn has shown to be shared (the prefix seen for the second time), plus
everything at a branch point. For a fixed-size state ("checkpoint" kinds) both keep one
checkpoint per decision instead of every block. `RecomputeCost` says how many FLOPs a cached entry
saves per byte it occupies; `TierEntryScore` turns it into the score of one tier entry (a KV page,
a compressed entry, a state checkpoint), and `GreedyDualOrder` (greedy_dual.py) evicts by that score
and recency (the host and disk tiers use it). Host only: never imports jax, never moves bytes.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.kv.offload.greedy_dual import GreedyDualOrder

__all__ = ["RetentionPolicy", "IntervalRetention", "MarconiRetention", "RecomputeCost", "make_retention",
           "GroupEntries", "TierEntryScore", "GreedyDualOrder"]


class RetentionPolicy(Protocol):
    """Decides, at the end of a turn, which of its prompt's blocks a lower tier should store."""

    name: str

    def select(self, keys: Sequence[Hashable], branch_point: bool = False) -> np.ndarray:
        """Indices (ascending) into `keys`, the prompt's block keys in order, of the blocks to store."""
        ...


class IntervalRetention:
    """Store at the end of every prompt: every block (KV kinds), or the state at the prompt's end
    (`checkpoint=True`: one index, the last full block)."""

    name = "interval"

    def __init__(self, checkpoint: bool = False):
        self.checkpoint = checkpoint

    def select(self, keys: Sequence[Hashable], branch_point: bool = False) -> np.ndarray:
        count = len(keys)
        if self.checkpoint:
            return np.arange(count - 1, count) if count else np.zeros(0, dtype=np.int64)
        return np.arange(count)


class MarconiRetention:
    """Marconi-style selective retention: store a prefix once a second turn has been seen with it.

    A turn's blocks [0, shared) are stored, where `shared` is the longest prefix of its keys that an
    earlier turn also had (keys name whole prefixes, as chained block hashes do); a branch point
    stores the whole prompt. With `checkpoint=True` only the last of those blocks is stored (one
    state at the fork point). Remembers up to `max_keys` keys, oldest forgotten first.
    """

    name = "marconi"

    def __init__(self, checkpoint: bool = False, max_keys: int = 10_000_000):
        if max_keys < 1:
            raise InvalidRequestError(f"max_keys must be >= 1, got {max_keys}")
        self.checkpoint = checkpoint
        self.max_keys = max_keys
        self._seen: dict[Hashable, None] = {}

    def shared_prefix(self, keys: Sequence[Hashable]) -> int:
        """Blocks of the longest prefix an earlier turn had (a binary search: prefixes are nested)."""
        low, high = 0, len(keys)
        while low < high:
            middle = (low + high + 1) // 2
            if keys[middle - 1] in self._seen:
                low = middle
            else:
                high = middle - 1
        return low

    def select(self, keys: Sequence[Hashable], branch_point: bool = False) -> np.ndarray:
        keys = keys.tolist() if isinstance(keys, np.ndarray) else list(keys)
        shared = len(keys) if branch_point else self.shared_prefix(keys)
        seen = self._seen
        for key in keys:
            seen[key] = None
        while len(seen) > self.max_keys:
            del seen[next(iter(seen))]
        if self.checkpoint:
            return np.arange(shared - 1, shared) if shared else np.zeros(0, dtype=np.int64)
        return np.arange(shared)


def make_retention(name: str, checkpoint: bool = False) -> RetentionPolicy:
    """A retention policy by name: "interval" or "marconi"."""
    if name == "interval":
        return IntervalRetention(checkpoint)
    if name == "marconi":
        return MarconiRetention(checkpoint)
    raise InvalidRequestError(f"unknown retention policy {name!r}; choose interval or marconi")


@dataclass(frozen=True)
class RecomputeCost:
    """FLOPs to recompute cached entries, per byte they occupy, for one model.

    `active_params` (MoE: the active ones) cost 2 FLOPs per token each; attention costs
    `attention_flops_per_pair` per (query token, earlier token) pair, i.e. 4 x the sum over
    attention layers of query heads x head dim (QK and PV products, 2 FLOPs per multiply-add).
    """

    active_params: float
    attention_flops_per_pair: float

    def __post_init__(self) -> None:
        if not self.active_params >= 0 or not self.attention_flops_per_pair >= 0:
            raise InvalidRequestError(f"active_params={self.active_params} and attention_flops_per_pair="
                                      f"{self.attention_flops_per_pair} must be >= 0")

    @classmethod
    def for_model(cls, active_params: float, num_attention_layers: int, num_heads: int,
                  head_dim: int) -> "RecomputeCost":
        return cls(active_params, 4.0 * num_attention_layers * num_heads * head_dim)

    def token_flops(self, start: np.ndarray | float, count: np.ndarray | float) -> np.ndarray:
        """FLOPs to run tokens [start, start + count) with the tokens before `start` cached."""
        start = np.asarray(start, dtype=np.float64)
        count = np.asarray(count, dtype=np.float64)
        pairs = count * start + count * (count + 1) / 2
        return 2.0 * self.active_params * count + self.attention_flops_per_pair * pairs

    def flops_per_byte(self, start: np.ndarray | float, tokens: np.ndarray | float, entry_bytes: float,
                       checkpoint: bool = False) -> np.ndarray:
        """FLOPs saved per byte by an entry of `entry_bytes` covering tokens [start, start + tokens).
        A KV page saves its own tokens; a state checkpoint (`checkpoint=True`) saves the whole
        prefix up to its end, since a state cannot be rebuilt from later tokens alone."""
        if not entry_bytes > 0:
            raise InvalidRequestError(f"entry_bytes must be > 0, got {entry_bytes}")
        start = np.asarray(start, dtype=np.float64)
        tokens = np.asarray(tokens, dtype=np.float64)
        flops = self.token_flops(0.0, start + tokens) if checkpoint else self.token_flops(start, tokens)
        return flops / entry_bytes

    def block_scorer(self, block_tokens: int, block_bytes: float,
                     checkpoint: bool = False) -> Callable[[np.ndarray], np.ndarray]:
        """position (block index) -> FLOPs per byte, for `MarconiPolicy(flops_per_byte=...)`."""
        def score(positions: np.ndarray) -> np.ndarray:
            start = np.maximum(np.asarray(positions, dtype=np.float64), 0.0) * block_tokens
            return self.flops_per_byte(start, block_tokens, block_bytes, checkpoint)
        return score


@dataclass(frozen=True)
class GroupEntries:
    """What one KV group's tier entries are: tokens per page, bytes per page, and whether an entry is
    a state checkpoint (a fixed-size state that stands for the whole prefix before it)."""

    tokens_per_page: int
    bytes_per_page: int
    checkpoint: bool = False


class TierEntryScore:
    """FLOPs per byte that one tier entry saves: what a later lookup would recompute without it.

    A prefix hit stops at the first missing page, so a KV page at block `position` of a stored turn of
    `num_blocks` blocks (attention KV, MLA latents, compressed entries, indexer keys) saves the
    recompute of blocks position..num_blocks-1, and heads outweigh tails (a chain loses its tail
    first); a compressed entry covers its group's `tokens_per_page` tokens per page, so it saves more
    per byte than an uncompressed page. A state checkpoint after block `position` saves the whole
    prefix up to its end. `score(group, position, num_blocks)`."""

    def __init__(self, cost: RecomputeCost, groups: Sequence[GroupEntries]):
        for entries in groups:
            if entries.tokens_per_page < 1 or entries.bytes_per_page < 1:
                raise InvalidRequestError(f"a group's entries need tokens_per_page >= 1 and bytes_per_page >= 1, "
                                          f"got {entries}")
        self.cost = cost
        self.groups = tuple(groups)

    def scores(self, group: int, positions, num_blocks: int) -> list[float]:
        """`score` of many entries of one group at once (numpy)."""
        entries = self.groups[group]
        size = entries.tokens_per_page
        if isinstance(positions, range):  # a turn's unstored tail: the same floats without a Python loop
            positions = np.arange(positions.start, positions.stop, positions.step, dtype=np.float64)
        positions = np.asarray(positions, dtype=np.float64)
        if entries.checkpoint:
            flops = self.cost.token_flops(0.0, (positions + 1) * size)
        else:
            flops = self.cost.token_flops(positions * size, np.maximum(num_blocks - positions, 1) * size)
        return (flops / entries.bytes_per_page).tolist()

    def __call__(self, group: int, position: int, num_blocks: int) -> float:
        entries = self.groups[group]
        size = entries.tokens_per_page
        if entries.checkpoint:
            flops = self.cost.token_flops(0.0, (position + 1) * size)
        else:
            flops = self.cost.token_flops(position * size, max(num_blocks - position, 1) * size)
        return float(flops) / entries.bytes_per_page
