"""The fixed pool of KV pages: reference counts, the reserved null page, the cached-page index and
the free queue whose order decides eviction.

Freed pages that still hold a hash stay hittable until a new allocation reuses them. The eviction
order is a small protocol (`EvictionOrder`), so that session pins or cost-aware scores plug in
without touching the pool. Host only: never imports jax.
"""
from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.kv.events import BlockRemoved, BlockStored, KVEvent
from agentjax.kv.hashing import BlockHash

logger = logging.getLogger(__name__)

NULL_PAGE = 0


class EvictionOrder(Protocol):
    """Decides which free page a new allocation takes (and so which cached page is evicted).

    The pool calls `push_free` with pages whose reference count just reached zero, in the order in
    which they should go (a request's tail before its head), and `pop_victims` to take free pages.
    A page that leaves the free set because a lookup hit it is never announced: an order must check
    `pool_ref_counts[page] == 0` itself (lazy deletion keeps a hit O(1) and vectorised).
    """

    def bind(self, pool_ref_counts: np.ndarray) -> None: ...

    def push_free(self, pages: np.ndarray) -> None: ...

    def pop_victims(self, count: int) -> np.ndarray: ...


class LRUEvictionOrder:
    """Least recently freed first; pages freed together keep the order they were given.

    A queue of (page, stamp) entries in a numpy ring with lazy deletion: an entry is live while its
    page is free and was not freed again later (a newer stamp). `pop_victims` filters whole chunks
    in numpy, so a 1,000-page allocation costs a few vector operations, not 1,000 list unlinks.
    """

    def __init__(self) -> None:
        self._ref_counts = np.zeros(0, dtype=np.int32)
        self._page_stamp = np.zeros(0, dtype=np.int64)
        self._queue_pages = np.zeros(0, dtype=np.int32)
        self._queue_stamps = np.zeros(0, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._next_stamp = 1

    def bind(self, pool_ref_counts: np.ndarray) -> None:
        num_pages = len(pool_ref_counts)
        self._ref_counts = pool_ref_counts
        self._page_stamp = np.zeros(num_pages, dtype=np.int64)
        capacity = 2 * num_pages + 64
        self._queue_pages = np.zeros(capacity, dtype=np.int32)
        self._queue_stamps = np.zeros(capacity, dtype=np.int64)

    def push_free(self, pages: np.ndarray) -> None:
        count = len(pages)
        if count == 0:
            return
        if self._tail + count > len(self._queue_pages):
            self._compact(count)
        stamps = np.arange(self._next_stamp, self._next_stamp + count, dtype=np.int64)
        self._next_stamp += count
        self._page_stamp[pages] = stamps
        self._queue_pages[self._tail:self._tail + count] = pages
        self._queue_stamps[self._tail:self._tail + count] = stamps
        self._tail += count

    def pop_victims(self, count: int) -> np.ndarray:
        taken: list[np.ndarray] = []
        need = count
        while need > 0 and self._head < self._tail:
            end = min(self._tail, self._head + max(2 * need, 64))
            pages = self._queue_pages[self._head:end]
            live = (self._ref_counts[pages] == 0) & (self._page_stamp[pages] == self._queue_stamps[self._head:end])
            positions = np.flatnonzero(live)
            if len(positions) >= need:
                positions = positions[:need]
                self._head += int(positions[-1]) + 1
            else:
                self._head = end
            taken.append(pages[positions].copy())
            need -= len(positions)
        if need > 0:
            raise OutOfPagesError(f"eviction order holds {count - need} free pages, {count} requested")
        if len(taken) == 1:
            victims = taken[0]
        else:
            victims = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int32)
        self._page_stamp[victims] = 0  # their entries are spent
        return victims

    def live_pages_in_order(self) -> np.ndarray:
        """The free pages, first victim first (for tests and debugging)."""
        pages = self._queue_pages[self._head:self._tail]
        live = (self._ref_counts[pages] == 0) & (self._page_stamp[pages] == self._queue_stamps[self._head:self._tail])
        return pages[live].copy()

    def _compact(self, incoming: int) -> None:
        live_pages = self._queue_pages[self._head:self._tail]
        live_stamps = self._queue_stamps[self._head:self._tail]
        live = (self._ref_counts[live_pages] == 0) & (self._page_stamp[live_pages] == live_stamps)
        live_pages, live_stamps = live_pages[live].copy(), live_stamps[live].copy()
        capacity = len(self._queue_pages)
        while len(live_pages) + incoming > capacity // 2:
            capacity *= 2
        if capacity != len(self._queue_pages):
            self._queue_pages = np.zeros(capacity, dtype=np.int32)
            self._queue_stamps = np.zeros(capacity, dtype=np.int64)
        self._queue_pages[:len(live_pages)] = live_pages
        self._queue_stamps[:len(live_pages)] = live_stamps
        self._head, self._tail = 0, len(live_pages)


class BlockPool:
    """`num_pages` pages of one byte size; page 0 is the null page and is never handed out.

    `cached[group][hash]` maps a group's block hash to the page that holds it; the group id is
    thus part of the lookup key. Events (`BlockStored`, `BlockRemoved`) are recorded when enabled.
    """

    def __init__(self, num_pages: int, num_groups: int = 1, eviction_order: EvictionOrder | None = None,
                 enable_events: bool = False):
        if num_pages < 2:
            raise InvalidRequestError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        self.ref_counts[NULL_PAGE] = 1  # never free, never evicted
        self.page_hash: list[BlockHash | None] = [None] * num_pages
        self.page_group = np.full(num_pages, -1, dtype=np.int16)
        self.cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.eviction_order = eviction_order or LRUEvictionOrder()
        self.eviction_order.bind(self.ref_counts)
        self.eviction_order.push_free(np.arange(1, num_pages, dtype=np.int32))
        self.num_free = num_pages - 1
        self.num_cached = 0
        self.evictions = 0
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.version = 0  # bumped by every change that can alter a lookup or an allocation

    # -- queries -------------------------------------------------------------------------------
    def cached_page(self, group: int, block_hash: BlockHash) -> int | None:
        return self.cached[group].get(block_hash)

    def count_free_among(self, pages: np.ndarray) -> int:
        """How many of `pages` are free (hits on them take them out of the free count)."""
        return int(np.count_nonzero(self.ref_counts[pages] == 0)) if len(pages) else 0

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, pages: np.ndarray) -> None:
        """Take a reference on each of the distinct cached `pages` (a prefix hit)."""
        self.version += 1
        if len(pages) == 0:
            return
        refs = self.ref_counts[pages]
        self.num_free -= int(np.count_nonzero(refs == 0))
        self.ref_counts[pages] = refs + 1

    def allocate(self, count: int) -> np.ndarray:
        """Take `count` free pages (reference count 1), evicting their cached hashes."""
        self.version += 1
        if count > self.num_free:
            raise OutOfPagesError(f"need {count} free KV pages, only {self.num_free} free")
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        pages = self.eviction_order.pop_victims(count)
        self.ref_counts[pages] = 1
        self.num_free -= count
        page_hash = self.page_hash
        for page in pages.tolist():
            if page_hash[page] is not None:
                self._evict(page)
        return pages

    def release(self, pages: np.ndarray) -> None:
        """Drop one reference on each of the distinct `pages`, which list the first to be evicted first."""
        self.version += 1
        if len(pages) == 0:
            return
        pages = pages[pages != NULL_PAGE]
        refs = self.ref_counts[pages] - 1
        if (refs < 0).any():
            raise InvalidRequestError(f"pages {pages[refs < 0].tolist()} released more often than taken")
        self.ref_counts[pages] = refs
        freed = pages[refs == 0]
        self.num_free += len(freed)
        self.eviction_order.push_free(freed)

    def cache_page(self, page: int, group: int, block_hash: BlockHash, parent: BlockHash | None,
                   tokens: tuple[int, ...] | None = None) -> bool:
        """Make `page` hittable under (group, hash); False if that block is already cached elsewhere."""
        self.version += 1
        index = self.cached[group]
        if block_hash in index or self.page_hash[page] is not None:
            return False
        index[block_hash] = page
        self.page_hash[page] = block_hash
        self.page_group[page] = group
        self.num_cached += 1
        if self.enable_events:
            self.events.append(BlockStored(block_hash, parent, tokens or (), group))
        return True

    def evict(self, page: int) -> bool:
        """Make a cached page unhittable now (an operator reset, or a tier that moved it); False if
        it held no hash. The page itself stays with its owners or in the free queue."""
        self.version += 1
        if self.page_hash[page] is None:
            return False
        self._evict(page)
        return True

    def _evict(self, page: int) -> None:
        block_hash = self.page_hash[page]
        group = int(self.page_group[page])
        del self.cached[group][block_hash]
        self.page_hash[page] = None
        self.page_group[page] = -1
        self.num_cached -= 1
        self.evictions += 1
        if self.enable_events:
            self.events.append(BlockRemoved(block_hash, group))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError if the counters disagree with the arrays (tests call this)."""
        assert self.ref_counts[NULL_PAGE] >= 1
        free = np.flatnonzero(self.ref_counts == 0)
        assert len(free) == self.num_free, (len(free), self.num_free)
        assert (self.ref_counts >= 0).all()
        assert sum(len(index) for index in self.cached) == self.num_cached
        for group, index in enumerate(self.cached):
            for block_hash, page in index.items():
                assert self.page_hash[page] == block_hash and self.page_group[page] == group
