"""The pool's default eviction order: least recently freed first, pinned pages last.

`PinnedEvictionOrder` is `LRUEvictionOrder` (agentjax/kv/eviction.py) with the KV cache's one pin table
(agentjax/kv/pins.py) on top: free pages a pin protects move to a pinned tier, taken only when every
unpinned free page is gone, earliest expiry first. Host only: never imports jax, never reads page contents.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable

import numpy as np

from agentjax.errors import OutOfPagesError
from agentjax.kv.eviction import LRUEvictionOrder
from agentjax.kv.eviction_groups import fresh_stamps, pop_in_range
from agentjax.kv.pins import PinTable

__all__ = ["PinnedEvictionOrder"]


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
        self.pins = PinTable(clock, np.int32)
        self.pins.listener = self
        self._tier: list[tuple[float, int, int, int]] = []  # (expiry, stamp, page, sequence), a heap
        self._last_from_tier: np.ndarray | None = None
        self.bind(np.zeros(0, dtype=np.int32))

    def bind(self, pool_ref_counts: np.ndarray) -> None:
        super().bind(pool_ref_counts)
        num_pages = len(pool_ref_counts)
        self.pins.bind(num_pages)
        self._in_tier = np.zeros(num_pages, dtype=bool)
        self._tier_sequence = np.zeros(num_pages, dtype=np.int64)

    @property
    def pinned_evictions(self) -> int:
        return self.pins.pinned_evictions

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        """Pin the distinct non-null `pages` under `key` (replacing its set); returns how many."""
        return self.pins.pin(key, pages, expires_at)

    def unpin(self, key: Hashable) -> int:
        """Release `key`'s pin now; returns how many pages it still protected (0 if none)."""
        return self.pins.unpin(key)

    def num_pinned(self) -> tuple[int, int]:
        """(pages under a live pin, of which free)."""
        return self.pins.num_pinned(self._ref_counts)

    def pin_keys(self) -> list[Hashable]:
        return self.pins.keys()

    def pinned_mask(self, pages: np.ndarray) -> np.ndarray:
        """Which of `pages` (any shape) a live pin protects."""
        return self.pins.pinned_mask(pages)

    # What the pin table reports (`PinListener`): the pinned tier follows the pins' expiries.
    def pins_grew(self, pages: np.ndarray) -> None:
        grown = pages[self._in_tier[pages] & (self._ref_counts[pages] == 0)]
        if len(grown):
            self._to_tier(grown, self._page_stamp[grown])

    def pins_released(self, released: np.ndarray, still: np.ndarray) -> None:
        if len(still):
            rekey = still[self._in_tier[still] & (self._ref_counts[still] == 0)]
            if len(rekey):
                self._to_tier(rekey, self._page_stamp[rekey])
        back = released[self._in_tier[released] & (self._ref_counts[released] == 0)]
        self._in_tier[released] = False
        if len(back):
            LRUEvictionOrder.reinstate(self, back, self._page_stamp[back])
        if not self.pins.active:
            self._tier.clear()
            self._in_tier[:] = False

    def _to_tier(self, pages: np.ndarray, stamps: np.ndarray) -> None:
        self._in_tier[pages] = True
        sequences = self._tier_sequence[pages] + 1
        self._tier_sequence[pages] = sequences
        tier = self._tier
        for entry in zip(self.pins.expiry[pages].tolist(), stamps.tolist(), pages.tolist(), sequences.tolist()):
            heapq.heappush(tier, entry)

    def _tier_entry_live(self, stamp: int, page: int, sequence: int) -> bool:
        return bool(self._in_tier[page] and self._tier_sequence[page] == sequence and self._ref_counts[page] == 0
                    and self._page_stamp[page] == stamp)

    # -- the order -------------------------------------------------------------------------------
    def push_free(self, pages: np.ndarray) -> None:
        if self.pins.active:
            self._in_tier[pages] = False
        super().push_free(pages)

    def pop_victims(self, count: int, allowed: tuple[int, int] | None = None,
                    page_group: np.ndarray | None = None) -> np.ndarray:
        if allowed is not None:
            return pop_in_range(self, count, *allowed, page_group)
        self._last_from_tier = None
        if self.pins.active:
            self.pins.expire()
        if not self.pins.active:
            return super().pop_victims(count)
        pin_count = self.pins.count
        taken: list[np.ndarray] = []
        need = count
        while need > 0 and self._head < self._tail:  # the LRU tier; pinned pages met move to the pinned tier
            end = min(self._tail, self._head + max(2 * need, 64))
            pages = self._queue_pages[self._head:end]
            stamps = self._queue_stamps[self._head:end]
            live = self._is_live(pages, stamps)
            pinned = live & (pin_count[pages] > 0)
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
            if self._tier_entry_live(stamp, page, sequence):
                self._in_tier[page] = False
                from_tier.append(page)
                need -= 1
        if need > 0:
            raise OutOfPagesError(f"eviction order holds {count - need} free pages, {count} requested")
        return self._finish_victims(taken, from_tier)

    def _finish_victims(self, taken: list[np.ndarray], from_tier: list[int]) -> np.ndarray:
        """The victims of one `pop_victims`: the LRU tier's, then the pinned tier's, whose content and
        so whose pins are gone (evicted under pressure); remembered for the undo record."""
        if from_tier:
            evicted = np.asarray(from_tier, dtype=np.int32)
            self.pins.evicted(evicted, all_pinned=True)
            taken.append(evicted)
        victims = np.concatenate(taken) if len(taken) != 1 else taken[0]
        if from_tier:
            self._last_from_tier = np.zeros(len(victims), dtype=bool)
            self._last_from_tier[len(victims) - len(from_tier):] = True
        self._last_victims = victims
        return victims

    def live_pages_in_order(self) -> np.ndarray:
        """The free pages, first victim first: unpinned in LRU order, then pinned by expiry."""
        self.pins.expire()
        lru = super().live_pages_in_order()
        if not self.pins.active:
            return lru
        pin_count, expiry = self.pins.count, self.pins.expiry
        unpinned = lru[pin_count[lru] == 0]
        pinned = [page for page in lru.tolist() if pin_count[page] > 0]
        in_tier = [(e, s, p) for e, s, p, q in self._tier if self._tier_entry_live(s, p, q)]
        both = sorted(in_tier + [(float(expiry[p]), int(self._page_stamp[p]), p) for p in pinned])
        return np.concatenate([unpinned, np.asarray([p for _, _, p in both], dtype=np.int32)])

    def push_fresh(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        self.reinstate(pages, _pairs(fresh_stamps(self, len(pages)), self.pins.generation[pages]))

    def on_reclaimed(self, pages: np.ndarray) -> None:
        """Free pages whose slab went to another group: their content, and so their pins, are gone."""
        pinned = pages[self.pins.count[pages] > 0]
        if len(pinned):
            self.pins.evicted(pinned, all_pinned=True)

    # -- undo ------------------------------------------------------------------------------------
    def positions(self, pages: np.ndarray) -> np.ndarray:
        return _pairs(self._page_stamp[pages], self.pins.generation[pages])

    def victim_positions(self) -> np.ndarray:
        victims = self._last_victims
        generations = self.pins.generation[victims]
        if self._last_from_tier is not None:
            generations = generations - self._last_from_tier
        return _pairs(self._page_stamp[victims], generations)

    def reinstate(self, pages: np.ndarray, positions: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int32)
        if len(pages) == 0:
            return
        positions = np.asarray(positions, dtype=np.int64).reshape(len(pages), 2)
        self.pins.restore_generations(pages, positions[:, 1])  # an undone eviction of pinned pages
        self._in_tier[pages] = False
        super().reinstate(pages, positions[:, 0])


def _pairs(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """`np.stack([first, second], axis=1)` as int64, without its per-call overhead (once per admission)."""
    out = np.empty((len(first), 2), dtype=np.int64)
    out[:, 0] = first
    out[:, 1] = second
    return out
