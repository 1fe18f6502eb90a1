"""Per-request KV bookkeeping: the token buffer, the chained block hashes and one table per group.

Plain containers that the manager mutates; they own no policy. Host only: never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentjax.kv.groups import GroupManager, GroupTable
from agentjax.kv.hashing import BlockHash


class TokenBuffer:
    """A growable uint32 token array (amortised O(1) appends for decode)."""

    __slots__ = ("_data", "size")

    def __init__(self, tokens: np.ndarray):
        self._data = tokens
        self.size = len(tokens)

    def extend(self, new_tokens: np.ndarray) -> None:
        end = self.size + len(new_tokens)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data), 64), dtype=np.uint32)
            grown[:self.size] = self._data[:self.size]
            self._data = grown
        self._data[self.size:end] = new_tokens
        self.size = end

    def view(self) -> np.ndarray:
        return self._data[:self.size]


@dataclass
class AdmissionUndo:
    """What an admission changed, kept until the request is committed (see KVCacheManager)."""

    reused_pages: np.ndarray  # cached pages the hit took while they were free (reference count 0)
    reused_positions: np.ndarray  # where the eviction order held them
    new_pages: list[np.ndarray] = field(default_factory=list)  # pages taken from the free set
    new_positions: list[np.ndarray] = field(default_factory=list)
    evicted: list[tuple] = field(default_factory=list)  # batches (pages, hashes, groups, parents, tokens)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # pending copies the admission queued
    copy_sources: list[int] = field(default_factory=list)  # checkpoint pages those copies read
    slab_moves: list[tuple] = field(default_factory=list)  # slabs a SlabPool gave to another group
    num_tokens: int = 0  # counted in the manager's queries
    num_hit: int = 0  # counted in its hits
    group_hits: list[int] = field(default_factory=list)  # counted in its group_hits
    turn_end_hit: int = 0  # counted in its turn_end_hits


@dataclass
class RequestKV:
    req_id: str
    tokens: TokenBuffer
    root: BlockHash
    hashes: list[BlockHash]  # chained hash of every full base block hashed so far
    tables: list[GroupTable]
    num_cached_tokens: int
    num_computed: int = 0
    undo: AdmissionUndo | None = None  # None once committed
    branch_point: int = 0  # tokens where its cached attention pages end past any saved state (0: none)

    def tokens_of_page(self, group: GroupManager):
        size = group.tokens_per_page

        def tokens(j: int) -> tuple[int, ...]:
            return tuple(self.tokens.view()[j * size:(j + 1) * size].tolist())

        return tokens
