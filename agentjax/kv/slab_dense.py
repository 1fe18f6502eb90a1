"""The order in which a `SlabPool` hands out the free pages of one window or state group (`densest_free`
in agentjax/kv/slab_choice.py), kept up to date instead of sorted per allocation.

Each slab keeps its free pages in two small heaps, empty and cached, by (freed stamp, id); two heaps of
slabs merge them: one keyed (held pages desc, cached, stamp, id) of each slab's first page, one keyed
(cached, held desc, stamp, id) of the first page of each of its two heaps. A held count that changes
re-lists one slab, not its pages. Entries are lazy (checked on pop). Host only: never imports jax.
"""
from __future__ import annotations

import heapq

import numpy as np

# A heap is compacted once it holds this many entries more than twice its live ones.
COMPACT_SLACK = 256


class DenseOrder:
    """The free pages of group `group` of `pool`, in `densest_free`'s order."""

    def __init__(self, pool, group: int):
        self.pool = pool
        self.group = group
        self.base = int(pool.bases[group])
        self.per_slab = int(pool.pages_per_slab[group])
        self.slabs: dict[int, tuple[list, list]] = {}  # slab -> (empty, cached) heaps of (stamp, page)
        self.by_held: list[tuple] = []  # (-held, cached, stamp, page, slab): while no free slab is left
        self.by_cached: list[tuple] = []  # (cached, -held, stamp, page, slab): while free slabs remain
        self._listed: dict[int, tuple] = {}  # slab -> the tops it last listed (no duplicate entries)

    # -- what the pool reports -------------------------------------------------------------------
    def pages_listed(self, pages: list[int], relist: bool = True) -> None:
        """Free `pages` were freed, or their cached blocks came or went (`relist`: False where the
        caller relists their slabs)."""
        pool = self.pool
        cached = (pool.page_group[pages] >= 0).tolist()
        stamps = pool.free_stamp[pages].tolist()
        slabs = set()
        for page, is_cached, stamp in zip(pages, cached, stamps):
            slab = (page - self.base) // self.per_slab
            heap = self.slabs.setdefault(slab, ([], []))[is_cached]
            heapq.heappush(heap, (stamp, page))
            if len(heap) > 2 * self.per_slab + 8:
                heap[:] = sorted({e for e in heap if self._page_live(e, is_cached)})
            slabs.add(slab)
        if relist:
            for slab in slabs:
                self.relist(slab)

    def relist(self, slab: int) -> None:
        """`slab`'s held count or its first free pages changed: list it under its current keys."""
        heaps = self.slabs.get(slab)
        if heaps is None:
            return
        tops = (self._top(heaps[0], 0), self._top(heaps[1], 1))
        held = int(self.pool.slab_held[slab])
        if self._listed.get(slab) == (held, tops):
            return
        self._listed[slab] = (held, tops)
        if tops[0] is None and tops[1] is None:
            del self.slabs[slab]
            del self._listed[slab]
            return
        for cached, top in enumerate(tops):
            if top is not None:
                heapq.heappush(self.by_cached, (cached, -held, top[0], top[1], slab))
        cached, top = min((c, t) for c, t in enumerate(tops) if t is not None)
        heapq.heappush(self.by_held, (-held, cached, top[0], top[1], slab))
        self._maybe_compact()

    def slab_left(self, slab: int) -> None:
        """`slab` went to another group (none of its pages of this group is free now)."""
        self.slabs.pop(slab, None)
        self._listed.pop(slab, None)

    # -- the choice --------------------------------------------------------------------------------
    def pop(self, count: int, pinned, free_slabs_remain: bool) -> np.ndarray:
        """`count` free pages, which the caller takes: unpinned first, each in the order above (held
        counts as they are now); pinned pages passed over stay listed."""
        heap = self.by_cached if free_slabs_remain else self.by_held
        chosen: list[int] = []
        aside: list[tuple[int, int, int]] = []  # (cached, stamp, page) of pinned pages, in order
        while len(chosen) < count and heap:
            entry = heapq.heappop(heap)
            cached, held = (entry[0], -entry[1]) if free_slabs_remain else (entry[1], -entry[0])
            stamp, page, slab = entry[2], entry[3], entry[4]
            heaps = self.slabs.get(slab)
            if heaps is None or held != int(self.pool.slab_held[slab]) or \
                    self._top(heaps[cached], cached) != (stamp, page):
                continue
            while heaps[cached] and heaps[cached][0] == (stamp, page):  # this page leaves its slab's heap
                heapq.heappop(heaps[cached])
            self._listed.pop(slab, None)
            self.relist(slab)
            if pinned is not None and bool(pinned(np.asarray([page], dtype=np.int64))[0]):
                aside.append((cached, stamp, page))
            else:
                chosen.append(page)
        if len(chosen) < count:  # every unpinned free page is chosen: pinned ones, in the same order
            extra = count - len(chosen)
            chosen += [page for _, _, page in aside[:extra]]
            aside = aside[extra:]
        for cached, stamp, page in aside:
            slab = (page - self.base) // self.per_slab
            heapq.heappush(self.slabs.setdefault(slab, ([], []))[cached], (stamp, page))
            self._listed.pop(slab, None)
            self.relist(slab)
        return np.asarray(chosen, dtype=np.int32)

    # -- lazy entries ------------------------------------------------------------------------------
    def _page_live(self, entry: tuple[int, int], cached: int) -> bool:
        pool = self.pool
        stamp, page = entry
        return (pool.ref_counts[page] == 0 and int(pool.page_group[page] >= 0) == cached
                and int(pool.free_stamp[page]) == stamp)

    def _top(self, heap: list, cached: int) -> tuple[int, int] | None:
        while heap and not self._page_live(heap[0], cached):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _entry_live(self, entry: tuple, by_cached: bool) -> bool:
        cached, held = (entry[0], -entry[1]) if by_cached else (entry[1], -entry[0])
        heaps = self.slabs.get(entry[4])
        return (heaps is not None and held == int(self.pool.slab_held[entry[4]])
                and self._top(heaps[cached], cached) == (entry[2], entry[3]))

    def _maybe_compact(self) -> None:
        limit = 4 * len(self.slabs) + COMPACT_SLACK
        for by_cached, heap in ((True, self.by_cached), (False, self.by_held)):
            if len(heap) > limit:
                heap[:] = sorted({entry for entry in heap if self._entry_live(entry, by_cached)})

    def check(self, free: np.ndarray) -> None:
        """Assert that every free page of the group is listed, and every slab's first pages are listed
        under its current keys (tests; O(free pages + entries))."""
        listed = set()
        for heaps in self.slabs.values():
            for cached in (0, 1):
                listed |= {page for stamp, page in heaps[cached] if self._page_live((stamp, page), cached)}
        assert listed == set(free.tolist()), f"group {self.group}: free pages listed"
        by_cached = {(e[4], e[0]) for e in self.by_cached if self._entry_live(e, True)}
        by_held = {e[4] for e in self.by_held if self._entry_live(e, False)}
        for slab, heaps in self.slabs.items():
            tops = [self._top(heaps[c], c) for c in (0, 1)]
            assert all(top is None or (slab, c) in by_cached for c, top in enumerate(tops)), (self.group, slab)
            assert slab in by_held or tops == [None, None], (self.group, slab)
