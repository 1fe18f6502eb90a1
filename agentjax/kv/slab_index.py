"""What a `SlabPool` (agentjax/kv/slab_pool.py) keeps up to date so that no allocation scans a group's
page range: per group its cached free pages, its wholly free slabs and its owned slabs; the free pages
with nothing cached, lowest id first; the unowned slabs, lowest first; and for window and state groups
their free pages in the order `densest_free` takes them. Heaps are lazy: an entry counts while it
still describes its page (checked on pop), and a heap is compacted when stale entries outnumber the
live ones, so every update costs O(pages touched x log). `check` recomputes it all (tests).
Host only: never imports jax.
"""
from __future__ import annotations

import heapq

import numpy as np

from agentjax.kv.slab_dense import DenseOrder

FREE_SLAB = -1
# A lazy heap is compacted once it holds this many entries more than twice its live ones.
COMPACT_SLACK = 1024
# Listing a set of page ids in Python costs about as much as this many page ids of a vectorised scan.
SCAN_RATIO = 32


class SlabIndex:
    """The incremental bookkeeping of one `SlabPool`; the pool reports every change to it."""

    def __init__(self, pool):
        self.pool = pool
        groups = len(pool.pages_per_slab)
        self.cached_free: list[set[int]] = [set() for _ in range(groups)]
        self.whole: list[set[int]] = [set() for _ in range(groups)]  # owned slabs none of whose pages is held
        self.owned = np.zeros(groups, dtype=np.int64)
        self.empty_heap: list[list[int]] = [[] for _ in range(groups)]  # free pages holding nothing
        self.cached_heap: list[list[tuple[int, int]]] = [[] for _ in range(groups)]  # (freed stamp, page)
        # unowned slabs: every slab from `unowned_from` on that is still unowned, and those given back below it
        self.unowned_from = 1
        self.unowned_heap: list[int] = []
        self.dense = [DenseOrder(pool, g) if b else None for g, b in enumerate(pool.bounded)]  # window, state

    # -- what the pool reports -------------------------------------------------------------------
    def freed(self, pages: np.ndarray, relist: bool = True) -> None:
        """`pages` (one group's or several) just became free: reference count 0, stamp set (`relist`:
        False where `held_changed` follows for their slabs)."""
        if not len(pages):
            return
        pool = self.pool
        groups = pool.group_of(pages)
        cached = pool.page_group[pages] >= 0
        stamps = pool.free_stamp[pages].tolist()
        for page, group, is_cached, stamp in zip(pages.tolist(), groups.tolist(), cached.tolist(), stamps):
            if is_cached:
                self.cached_free[group].add(page)
                heapq.heappush(self.cached_heap[group], (stamp, page))
            else:
                heapq.heappush(self.empty_heap[group], page)
        for group in set(groups[cached].tolist()):
            self._maybe_compact_cached(group)
        self._list_dense(pages, groups, relist)

    def taken(self, pages: np.ndarray) -> None:
        """`pages` (all free now) are about to be held or to leave their group."""
        if not len(pages):
            return
        pool = self.pool
        cached = pages[pool.page_group[pages] >= 0]
        if len(cached):
            for page, group in zip(cached.tolist(), pool.group_of(cached).tolist()):
                self.cached_free[group].discard(page)

    def cached_changed(self, page: int, group: int, cached: bool) -> None:
        """Free `page` of `group` now holds a block (`cached`) or no longer does."""
        if cached:
            self.cached_free[group].add(page)
            heapq.heappush(self.cached_heap[group], (int(self.pool.free_stamp[page]), page))
            self._maybe_compact_cached(group)
        else:
            self.cached_free[group].discard(page)
            heapq.heappush(self.empty_heap[group], page)
        if self.dense[group] is not None:
            self.dense[group].pages_listed([page])

    def held_changed(self, slabs: np.ndarray, before: np.ndarray) -> None:
        """The held counts of the distinct owned `slabs` changed from `before`."""
        pool = self.pool
        after = pool.slab_held[slabs]
        owners = pool.slab_owner[slabs]
        for slab, owner, was, now in zip(slabs.tolist(), owners.tolist(), before.tolist(), after.tolist()):
            if was == 0 and now:
                self.whole[owner].discard(slab)
            elif now == 0 and was:
                self.whole[owner].add(slab)
            if self.dense[owner] is not None:
                self.dense[owner].relist(slab)

    def owner_changed(self, slab: int, old: int, new: int) -> None:
        """`slab` went from `old` to `new` (either may be FREE_SLAB); none of its pages is held."""
        if old >= 0:
            self.whole[old].discard(slab)
            self.owned[old] -= 1
            if self.dense[old] is not None:
                self.dense[old].slab_left(slab)
        if new >= 0:
            self.whole[new].add(slab)
            self.owned[new] += 1
        else:
            heapq.heappush(self.unowned_heap, slab)

    # -- what the pool asks ------------------------------------------------------------------------
    def num_cached_free(self, group: int) -> int:
        return len(self.cached_free[group])

    def whole_counts(self) -> np.ndarray:
        return np.asarray([len(slabs) for slabs in self.whole], dtype=np.int64)

    def first_unowned(self) -> int:
        """The lowest slab no group owns."""
        heap, owner = self.unowned_heap, self.pool.slab_owner
        while heap and owner[heap[0]] != FREE_SLAB:
            heapq.heappop(heap)
        while self.unowned_from < len(owner) and owner[self.unowned_from] != FREE_SLAB:
            self.unowned_from += 1
        first = min(heap[0] if heap else len(owner), self.unowned_from)
        if first == len(owner):
            raise LookupError("no unowned slab")
        return first

    def pop_empty(self, group: int, count: int) -> list[int]:
        """Up to `count` free pages of `group` holding nothing, lowest id first; the caller takes them."""
        heap = self.empty_heap[group]
        ref_counts, page_group = self.pool.ref_counts, self.pool.page_group
        out: list[int] = []
        last = -1
        while heap and len(out) < count:
            page = heapq.heappop(heap)
            if page != last and ref_counts[page] == 0 and page_group[page] < 0:
                out.append(page)
                last = page  # equal entries come out together: a page listed twice is taken once
        self._maybe_compact_empty(group)
        return out

    def oldest_cached_stamp(self, group: int) -> int | None:
        """The freed stamp of `group`'s cached free page freed longest ago (None: it has none)."""
        heap, pool = self.cached_heap[group], self.pool
        while heap:
            stamp, page = heap[0]
            if pool.ref_counts[page] == 0 and pool.page_group[page] >= 0 and pool.free_stamp[page] == stamp:
                return stamp
            heapq.heappop(heap)
        return None

    def cached_free_sorted(self, group: int) -> np.ndarray:
        """`group`'s cached free pages, lowest id first: from the set while it is small against the
        group's range, else by one vectorised pass over the range (fewer steps than a Python sort)."""
        cached = self.cached_free[group]
        start, stop = self.pool.group_range(group)
        if len(cached) * SCAN_RATIO < stop - start:
            return np.fromiter(sorted(cached), dtype=np.int64, count=len(cached))
        pool = self.pool
        free = start + np.flatnonzero(pool.ref_counts[start:stop] == 0)
        return free[pool.page_group[free] >= 0].astype(np.int64)

    def pop_dense(self, group: int, count: int, pinned) -> np.ndarray:
        """`densest_free`'s choice for window or state `group` (agentjax/kv/slab_dense.py)."""
        return self.dense[group].pop(count, pinned, bool(self.pool.num_unowned))

    def _list_dense(self, pages: np.ndarray, groups: np.ndarray, relist: bool) -> None:
        for group in np.unique(groups).tolist():
            if self.dense[group] is not None:
                self.dense[group].pages_listed(pages[groups == group].tolist(), relist)

    def _maybe_compact_cached(self, group: int) -> None:
        heap, pool = self.cached_heap[group], self.pool
        if len(heap) > 2 * len(self.cached_free[group]) + COMPACT_SLACK:
            heap[:] = sorted({(stamp, page) for stamp, page in heap if pool.ref_counts[page] == 0
                              and pool.page_group[page] >= 0 and pool.free_stamp[page] == stamp})

    def _maybe_compact_empty(self, group: int) -> None:
        heap = self.empty_heap[group]
        if len(heap) > 2 * int(self.pool.group_free[group]) + COMPACT_SLACK:
            ref_counts, page_group = self.pool.ref_counts, self.pool.page_group
            live = sorted({page for page in heap if ref_counts[page] == 0 and page_group[page] < 0})
            self.empty_heap[group] = live  # a sorted list is a heap


def check_index(pool) -> None:
    """Assert that `pool.index` agrees with a full recomputation from the pool's arrays (O(pool): tests)."""
    index = pool.index
    for group in range(len(pool.pages_per_slab)):
        start, stop = pool.group_range(group)
        ids = np.arange(start, stop, dtype=np.int64)
        free = ids[pool.ref_counts[start:stop] == 0]
        cached = free[pool.page_group[free] >= 0]
        empty = free[pool.page_group[free] < 0]
        assert index.cached_free[group] == set(cached.tolist()), f"group {group}: cached free pages"
        oldest = int(pool.free_stamp[cached].min()) if len(cached) else None
        assert index.oldest_cached_stamp(group) == oldest, f"group {group}: oldest cached free page"
        live_empty = {p for p in index.empty_heap[group] if pool.ref_counts[p] == 0 and pool.page_group[p] < 0}
        assert live_empty == set(empty.tolist()), f"group {group}: empty free pages"
        mine = np.flatnonzero(pool.slab_owner == group)
        assert index.owned[group] == len(mine), f"group {group}: owned slabs"
        assert index.whole[group] == set(mine[pool.slab_held[mine] == 0].tolist()), f"group {group}: whole slabs"
        if index.dense[group] is not None:
            index.dense[group].check(free)
        owned, held, cached_free = pool.group_usage()
        mine_ids = np.repeat(pool.slab_owner == group, int(pool.pages_per_slab[group]))
        assert (owned[group], held[group], cached_free[group]) == (
            len(mine), int(np.count_nonzero(mine_ids & (pool.ref_counts[start:stop] > 0))), len(cached)), group
    unowned = np.flatnonzero(pool.slab_owner == FREE_SLAB)
    below = unowned[unowned < index.unowned_from]
    assert set(below.tolist()) <= set(index.unowned_heap), "unowned slabs given back"
    if len(unowned):
        assert index.first_unowned() == int(unowned[0]), "the lowest unowned slab"
