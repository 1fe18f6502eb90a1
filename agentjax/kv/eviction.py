"""Eviction orders: which free KV page the next allocation takes, and so which cached page is lost.

`EvictionOrder` is the small protocol the pool (`agentjax.kv.block_pool`) talks to. `LRUEvictionOrder`
hands out the least recently freed page first; `PinnedEvictionOrder` (the pool's default) does the
same but keeps session and branch pins for last, earliest expiry first. Host only: never imports jax.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.kv.eviction_groups import fresh_stamps, pop_in_range

NULL_PAGE = 0  # the pool's reserved page: never free, never evicted


def distinct_pages(pages, dtype=np.int64) -> np.ndarray:
    """The distinct pages other than NULL_PAGE, ascending (a pin's set). A sort and a neighbour test:
    numpy 2.5's `np.unique` takes about 4x as long on a session's few hundred pages."""
    pages = np.sort(np.asarray(pages, dtype=dtype))
    keep = pages != NULL_PAGE
    keep[1:] &= pages[1:] != pages[:-1]
    return pages[keep]


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
        merged_pages = np.insert(self._queue_pages[self._head:self._tail], at, new_pages)
        merged_stamps = np.insert(queued, at, new_stamps)
        capacity = len(self._queue_pages)
        while len(merged_pages) > capacity // 2:
            capacity *= 2
        if capacity != len(self._queue_pages):
            self._queue_pages = np.zeros(capacity, dtype=np.int32)
            self._queue_stamps = np.zeros(capacity, dtype=np.int64)
        self._queue_pages[:len(merged_pages)] = merged_pages
        self._queue_stamps[:len(merged_pages)] = merged_stamps
        self._head, self._tail = 0, len(merged_pages)

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


@dataclass
class _Pin:
    pages: np.ndarray  # distinct page ids
    generations: np.ndarray  # each page's content generation when pinned (an eviction ends the pin)
    expires_at: float  # math.inf: until unpinned
    pin_id: int


class PinnedEvictionOrder(LRUEvictionOrder):
    """LRU over unpinned free pages, then a pinned tier: pinned free pages, earliest expiry first.

    `pin(key, pages, expires_at)` protects pages (held or free) for a session between turns or for
    a subagent fork point; a later `pin` with the same key replaces the set, `unpin(key)` releases
    it, and a pin whose `expires_at` has passed on `clock` is dropped, so its pages are plain LRU
    pages again (at their LRU position). Pinned pages still count as free. A pinned page that is
    evicted under pressure leaves every pin (its content is gone). With no pin anywhere,
    `pop_victims` is the plain LRU path.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self._pins: dict[Hashable, _Pin] = {}
        self._deadlines: list[tuple[float, int, Hashable]] = []  # (expires_at, pin id, key), a heap
        self._tier: list[tuple[float, int, int, int]] = []  # (expiry, stamp, page, sequence), a heap
        self._next_pin_id = 0
        self._last_from_tier: np.ndarray | None = None
        self.pinned_evictions = 0
        self.bind(np.zeros(0, dtype=np.int32))

    def bind(self, pool_ref_counts: np.ndarray) -> None:
        super().bind(pool_ref_counts)
        num_pages = len(pool_ref_counts)
        self._pin_count = np.zeros(num_pages, dtype=np.int32)
        self._pin_expiry = np.zeros(num_pages, dtype=np.float64)
        self._generation = np.zeros(num_pages, dtype=np.int64)
        self._in_tier = np.zeros(num_pages, dtype=bool)
        self._tier_sequence = np.zeros(num_pages, dtype=np.int64)

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        """Pin the distinct non-null `pages` under `key` (replacing its set); returns how many."""
        if key in self._pins:
            self._unpin(key)
        expiry = math.inf if expires_at is None else float(expires_at)
        if math.isnan(expiry):
            raise InvalidRequestError("expires_at is NaN; pass a clock time or None (until unpinned)")
        pages = distinct_pages(pages, np.int32)
        if len(pages) and not (0 < pages[-1] < len(self._pin_count)):
            raise InvalidRequestError(f"page {int(pages[-1])} outside [1, {len(self._pin_count)})")
        if expiry <= self.clock():
            return 0
        self._pins[key] = _Pin(pages, self._generation[pages].copy(), expiry, self._next_pin_id)
        if expires_at is not None:
            heapq.heappush(self._deadlines, (expiry, self._next_pin_id, key))
        self._next_pin_id += 1
        self._pin_count[pages] += 1
        old = self._pin_expiry[pages]
        new = np.maximum(old, expiry)
        self._pin_expiry[pages] = new
        grown = pages[(new > old) & self._in_tier[pages] & (self._ref_counts[pages] == 0)]
        if len(grown):
            self._to_tier(grown, self._page_stamp[grown])
        return len(pages)

    def unpin(self, key: Hashable) -> int:
        """Release `key`'s pin now; returns how many pages it still protected (0 if none)."""
        return self._unpin(key) if key in self._pins else 0

    def num_pinned(self) -> tuple[int, int]:
        """(pages under a live pin, of which free)."""
        self._expire(self.clock())
        pinned = self._pin_count > 0
        return int(np.count_nonzero(pinned)), int(np.count_nonzero(pinned & (self._ref_counts == 0)))

    def pin_keys(self) -> list[Hashable]:
        self._expire(self.clock())
        return list(self._pins)

    def _unpin(self, key: Hashable) -> int:
        pin = self._pins.pop(key)
        pages = pin.pages[self._generation[pin.pages] == pin.generations]
        self._pin_count[pages] -= 1
        left = self._pin_count[pages] > 0
        released, still = pages[~left], pages[left]
        self._pin_expiry[released] = 0.0
        if len(still):
            self._recompute(still)
            rekey = still[self._in_tier[still] & (self._ref_counts[still] == 0)]
            if len(rekey):
                self._to_tier(rekey, self._page_stamp[rekey])
        back = released[self._in_tier[released] & (self._ref_counts[released] == 0)]
        self._in_tier[released] = False
        if len(back):
            LRUEvictionOrder.reinstate(self, back, self._page_stamp[back])
        if not self._pins:
            self._tier.clear()
            self._deadlines.clear()
            self._in_tier[:] = False
        return len(pages)

    def _recompute(self, pages: np.ndarray) -> None:
        """Pin count and latest expiry of `pages` from the live pins (after an unpin or an undo)."""
        self._pin_count[pages] = 0
        self._pin_expiry[pages] = 0.0
        for pin in self._pins.values():
            member = np.isin(pin.pages, pages) & (self._generation[pin.pages] == pin.generations)
            if member.any():
                chosen = pin.pages[member]
                self._pin_count[chosen] += 1
                self._pin_expiry[chosen] = np.maximum(self._pin_expiry[chosen], pin.expires_at)

    def _expire(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, pin_id, key = heapq.heappop(deadlines)
            pin = self._pins.get(key)
            if pin is not None and pin.pin_id == pin_id:
                self._unpin(key)

    def _to_tier(self, pages: np.ndarray, stamps: np.ndarray) -> None:
        self._in_tier[pages] = True
        sequences = self._tier_sequence[pages] + 1
        self._tier_sequence[pages] = sequences
        tier = self._tier
        for entry in zip(self._pin_expiry[pages].tolist(), stamps.tolist(), pages.tolist(), sequences.tolist()):
            heapq.heappush(tier, entry)

    # -- the order -------------------------------------------------------------------------------
    def push_free(self, pages: np.ndarray) -> None:
        if self._pins:
            self._in_tier[pages] = False
        super().push_free(pages)

    def pop_victims(self, count: int, allowed: tuple[int, int] | None = None,
                    page_group: np.ndarray | None = None) -> np.ndarray:
        if allowed is not None:
            return pop_in_range(self, count, *allowed, page_group)
        self._last_from_tier = None
        if self._pins:
            self._expire(self.clock())
        if not self._pins:
            return super().pop_victims(count)
        taken: list[np.ndarray] = []
        need = count
        while need > 0 and self._head < self._tail:  # the LRU tier; pinned pages met move to the pinned tier
            end = min(self._tail, self._head + max(2 * need, 64))
            pages = self._queue_pages[self._head:end]
            stamps = self._queue_stamps[self._head:end]
            live = self._is_live(pages, stamps)
            pinned = live & (self._pin_count[pages] > 0)
            positions = np.flatnonzero(live & ~pinned)
            if len(positions) >= need:
                positions = positions[:need]
                cut = int(positions[-1]) + 1
            else:
                cut = end - self._head
            moved = np.flatnonzero(pinned[:cut])
            if len(moved):
                self._to_tier(pages[moved].copy(), stamps[moved].copy())
            self._head += cut
            taken.append(pages[positions].copy())
            need -= len(positions)
        from_tier: list[int] = []
        while need > 0 and self._tier:
            _, stamp, page, sequence = heapq.heappop(self._tier)
            if (self._in_tier[page] and self._tier_sequence[page] == sequence and self._ref_counts[page] == 0
                    and self._page_stamp[page] == stamp):
                self._in_tier[page] = False
                from_tier.append(page)
                need -= 1
        if need > 0:
            raise OutOfPagesError(f"eviction order holds {count - need} free pages, {count} requested")
        if from_tier:  # evicted under pressure: their content, and so their pins, are gone
            evicted = np.asarray(from_tier, dtype=np.int32)
            self._generation[evicted] += 1
            self._pin_count[evicted] = 0
            self._pin_expiry[evicted] = 0.0
            self.pinned_evictions += len(evicted)
            taken.append(evicted)
        victims = np.concatenate(taken) if len(taken) != 1 else taken[0]
        if from_tier:
            self._last_from_tier = np.zeros(len(victims), dtype=bool)
            self._last_from_tier[len(victims) - len(from_tier):] = True
        self._last_victims = victims
        return victims

    def live_pages_in_order(self) -> np.ndarray:
        """The free pages, first victim first: unpinned in LRU order, then pinned by expiry."""
        self._expire(self.clock())
        lru = super().live_pages_in_order()
        if not self._pins:
            return lru
        unpinned = lru[self._pin_count[lru] == 0]
        pinned = [page for page in lru.tolist() if self._pin_count[page] > 0]
        in_tier = [(e, s, p) for e, s, p, q in self._tier if self._in_tier[p] and self._tier_sequence[p] == q
                   and self._ref_counts[p] == 0 and self._page_stamp[p] == s]
        both = sorted(in_tier + [(float(self._pin_expiry[p]), int(self._page_stamp[p]), p) for p in pinned])
        return np.concatenate([unpinned, np.asarray([p for _, _, p in both], dtype=np.int32)])

    def push_fresh(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        self.reinstate(pages, _pairs(fresh_stamps(self, len(pages)), self._generation[pages]))

    def pinned_mask(self, pages: np.ndarray) -> np.ndarray:
        """Which of `pages` (any shape) a live pin protects."""
        self._expire(self.clock())
        return self._pin_count[pages] > 0

    def on_reclaimed(self, pages: np.ndarray) -> None:
        """Free pages whose slab went to another group: their content, and so their pins, are gone."""
        pinned = pages[self._pin_count[pages] > 0]
        if len(pinned):
            self._generation[pinned] += 1
            self._pin_count[pinned] = 0
            self._pin_expiry[pinned] = 0.0
            self.pinned_evictions += len(pinned)

    # -- undo ------------------------------------------------------------------------------------
    def positions(self, pages: np.ndarray) -> np.ndarray:
        return _pairs(self._page_stamp[pages], self._generation[pages])

    def victim_positions(self) -> np.ndarray:
        victims = self._last_victims
        generations = self._generation[victims]
        if self._last_from_tier is not None:
            generations = generations - self._last_from_tier
        return _pairs(self._page_stamp[victims], generations)

    def reinstate(self, pages: np.ndarray, positions: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        if len(pages) == 0:
            return
        positions = np.asarray(positions, dtype=np.int64).reshape(len(pages), 2)
        changed = self._generation[pages] != positions[:, 1]
        if changed.any():  # an undone eviction of pinned pages: their pins hold again
            self._generation[pages] = positions[:, 1]
            self._recompute(pages[changed])
        self._in_tier[pages] = False
        super().reinstate(pages, positions[:, 0])


def _pairs(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """`np.stack([first, second], axis=1)` as int64, without its per-call overhead (once per admission)."""
    out = np.empty((len(first), 2), dtype=np.int64)
    out[:, 0] = first
    out[:, 1] = second
    return out
