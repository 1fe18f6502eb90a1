"""Eviction orders: which free KV page the next allocation takes, and so which cached page is lost.

`EvictionOrder` is the small protocol the pool (`agentjax.kv.block_pool`) talks to. `LRUEvictionOrder`
hands out the least recently freed page first; `agentjax.kv.pinned_order.PinnedEvictionOrder` (the
pool's default) is the same order with the pin table (`agentjax.kv.pins`) on top, and
`agentjax.kv.policy_order.PolicyEvictionOrder` lets a KV policy choose instead. Host only: never
imports jax, never reads page contents.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from agentjax.errors import OutOfPagesError
from agentjax.kv.eviction_groups import fresh_stamps, pop_in_range
from agentjax.kv.pins import NULL_PAGE, distinct_pages

__all__ = ["NULL_PAGE", "EvictionOrder", "LRUEvictionOrder", "distinct_pages"]


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

    # Undo support (a rolled-back admission puts pages back where they were):
    def positions(self, pages: np.ndarray) -> np.ndarray:
        """Opaque per-page keys (axis 0 = pages) of where free `pages` sit now, for `reinstate`."""
        ...

    def victim_positions(self) -> np.ndarray:
        """The keys of where the pages of the last `pop_victims` call sat before it took them."""
        ...

    def reinstate(self, pages: np.ndarray, positions: np.ndarray) -> None:
        """Pages whose reference count is 0 again go back to `positions` (not to the MRU end)."""
        ...


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
        self._last_victims = np.zeros(0, dtype=np.int32)

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

    def pop_victims(self, count: int, allowed: tuple[int, int] | None = None,
                    page_group: np.ndarray | None = None) -> np.ndarray:
        if allowed is not None:
            return pop_in_range(self, count, *allowed, page_group)
        if count == 1 and (victim := self._first_live(8)) is not None:
            return victim
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
        # Their entries are spent (reference count 1); the stamps stay so that an undo can put them back.
        self._last_victims = victims
        return victims

    def _first_live(self, scan: int) -> np.ndarray | None:
        """The first live page among the next `scan` queue entries, taken as `pop_victims(1)` takes it
        (the head moves past it), or None (nothing moved) if those entries are all dead. A decode row's
        next page: a few scalar reads instead of the vectorised scan of a 64-entry chunk."""
        queue_pages, queue_stamps, ref_counts, page_stamp = (self._queue_pages, self._queue_stamps,
                                                             self._ref_counts, self._page_stamp)
        for position in range(self._head, min(self._tail, self._head + scan)):
            page = int(queue_pages[position])
            if ref_counts[page] == 0 and page_stamp[page] == queue_stamps[position]:
                self._head = position + 1
                self._last_victims = np.array([page], dtype=queue_pages.dtype)
                return self._last_victims
        return None

    def push_fresh(self, pages: np.ndarray) -> None:
        self.reinstate(pages, fresh_stamps(self, len(pages)))

    def positions(self, pages: np.ndarray) -> np.ndarray:
        return self._page_stamp[pages]

    def victim_positions(self) -> np.ndarray:
        return self._page_stamp[self._last_victims]

    def reinstate(self, pages: np.ndarray, positions: np.ndarray) -> None:
        """Queue entries are sorted by stamp, so a page goes back by a binary search; an entry still
        queued (a hit took the page, nothing passed it since) just becomes live again."""
        pages = np.asarray(pages, dtype=np.int32)
        stamps = np.asarray(positions, dtype=np.int64)
        if len(pages) == 0:
            return
        self._page_stamp[pages] = stamps
        queued = self._queue_stamps[self._head:self._tail]
        index = np.searchsorted(queued, stamps)
        inside = index < len(queued)
        present = np.zeros(len(stamps), dtype=bool)
        present[inside] = queued[index[inside]] == stamps[inside]
        if present.all():
            return
        missing = np.flatnonzero(~present)
        order = np.argsort(stamps[missing], kind="stable")
        missing = missing[order]
        new_pages, new_stamps, at = pages[missing], stamps[missing], index[missing]
        count = len(missing)
        if at[-1] == 0 and self._head >= count:  # all before the first queued entry: the usual case
            self._head -= count
            self._queue_pages[self._head:self._head + count] = new_pages
            self._queue_stamps[self._head:self._head + count] = new_stamps
            return
        self._refill(np.insert(self._queue_pages[self._head:self._tail], at, new_pages),
                     np.insert(queued, at, new_stamps))

    def live_pages_in_order(self) -> np.ndarray:
        """The free pages, first victim first (for tests and debugging)."""
        pages = self._queue_pages[self._head:self._tail]
        live = (self._ref_counts[pages] == 0) & (self._page_stamp[pages] == self._queue_stamps[self._head:self._tail])
        return pages[live].copy()

    def _is_live(self, pages: np.ndarray, stamps: np.ndarray) -> np.ndarray:
        return (self._ref_counts[pages] == 0) & (self._page_stamp[pages] == stamps)

    def _compact(self, incoming: int) -> None:
        live_pages = self._queue_pages[self._head:self._tail]
        live_stamps = self._queue_stamps[self._head:self._tail]
        live = (self._ref_counts[live_pages] == 0) & (self._page_stamp[live_pages] == live_stamps)
        self._refill(live_pages[live].copy(), live_stamps[live].copy(), incoming)

    def _refill(self, pages: np.ndarray, stamps: np.ndarray, incoming: int = 0) -> None:
        """The queue becomes `pages` (with their stamps) from index 0, its arrays doubled until at most
        half full with `incoming` more entries."""
        capacity = len(self._queue_pages)
        while len(pages) + incoming > capacity // 2:
            capacity *= 2
        if capacity != len(self._queue_pages):
            self._queue_pages = np.zeros(capacity, dtype=np.int32)
            self._queue_stamps = np.zeros(capacity, dtype=np.int64)
        self._queue_pages[:len(pages)] = pages
        self._queue_stamps[:len(pages)] = stamps
        self._head, self._tail = 0, len(pages)
