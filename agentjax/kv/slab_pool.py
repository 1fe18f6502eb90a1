"""The block pool of a "pool" KV layout: page ids per group over slabs of memory that change hands.

Group g owns the ids `[base[g], base[g] + num_slabs * k[g])`; id `base[g] + s * k[g] + j` is page j
of slab s. A slab belongs to one group at a time; the ids of the other groups in it are held by the
slab map (reference count 1), so no eviction order ever hands them out. Allocation of a group's pages
takes its own empty pages, then free slabs, then either its own cached pages (in its eviction order) or
a whole free slab of another group, whichever was freed longer ago (docs/design/kv_memory.md).
Counts that mix groups are in units (`units_per_page`). No allocation, release or hit scans a group's
page range: `SlabIndex` (agentjax/kv/slab_index.py) keeps what the choices read. Host only: never
imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentjax.errors import OutOfPagesError
from agentjax.kv.block_pool import NULL_PAGE, BlockPool
from agentjax.kv.eviction import EvictionOrder
from agentjax.kv.slab_choice import densest_free, reclaimable, take_older_slabs
from agentjax.kv.slab_index import FREE_SLAB, SlabIndex, check_index

NULL_SLAB = -2


class SlabPool(BlockPool):
    """`BlockPool` over slabs: `pages_per_slab[g]` pages of group g per slab, `num_slabs` slabs (slab 0
    is the null slab)."""

    num_groups_share_ids = False

    def __init__(self, num_slabs: int, pages_per_slab: Sequence[int], eviction_order: EvictionOrder | None = None,
                 enable_events: bool = False, bounded: Sequence[bool] | None = None):
        """`bounded[g]`: group g holds a bounded number of pages per request (a window or a state); its
        new pages go to the slabs its requests already use most, so the others drain and can change hands."""
        per_slab = np.asarray(pages_per_slab, dtype=np.int64)
        ids = num_slabs * per_slab
        super().__init__(int(ids.sum()), len(per_slab), eviction_order, enable_events)
        self.num_slabs = num_slabs
        self.pages_per_slab = per_slab
        self.bases = np.concatenate([[0], np.cumsum(ids)[:-1]]).astype(np.int64)
        self.units_per_slab = int(np.lcm.reduce(per_slab))
        self.units_per_page = self.units_per_slab // per_slab
        self.ref_counts[:] = 1  # every id is held by the slab map until its slab is given to its group
        self.num_free = 0
        self.slab_owner = np.full(num_slabs, FREE_SLAB, dtype=np.int32)
        self.slab_owner[0] = NULL_SLAB
        self.slab_held = np.zeros(num_slabs, dtype=np.int64)  # pages of the owner held by requests
        self.group_free = np.zeros(len(per_slab), dtype=np.int64)
        self.num_unowned = num_slabs - 1
        self.free_stamp = np.zeros(self.num_pages, dtype=np.int64)  # when each page was last freed
        self.bounded = list(bounded) if bounded is not None else [False] * len(per_slab)
        self._stamp = 1
        self.slab_moves = 0  # conversions: a slab given to a group
        self.slab_trades = 0  # of which the slab came from another group (not from the free slabs)
        self.index = SlabIndex(self)

    # -- ids ---------------------------------------------------------------------------------------
    def group_of(self, pages: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bases, pages, side="right") - 1

    def slab_of(self, pages: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
        groups = self.group_of(pages) if groups is None else groups
        return (pages - self.bases[groups]) // self.pages_per_slab[groups]

    def slab_pages(self, slab: int, group: int) -> np.ndarray:
        k = int(self.pages_per_slab[group])
        start = int(self.bases[group]) + slab * k
        return np.arange(start, start + k, dtype=np.int64)

    def group_range(self, group: int) -> tuple[int, int]:
        start = int(self.bases[group])
        return start, start + self.num_slabs * int(self.pages_per_slab[group])

    # -- units ---------------------------------------------------------------------------------------
    def free_units(self) -> int:
        return int((self.group_free * self.units_per_page).sum()) + self.num_unowned * self.units_per_slab

    def capacity_units(self) -> int:
        return (self.num_slabs - 1) * self.units_per_slab

    def page_units(self, pages, by_group: bool = False) -> int:
        """Units of `pages` (with `by_group`: of one page of each group listed)."""
        pages = np.asarray(pages, dtype=np.int64)
        if not len(pages):
            return 0
        return int(self.units_per_page[pages if by_group else self.group_of(pages)].sum())

    def count_units(self, count: int) -> int:
        return count * int(self.units_per_page.max())

    def free_units_among(self, pages: np.ndarray) -> int:
        pages = np.asarray(pages, dtype=np.int64)
        return self.page_units(pages[self.ref_counts[pages] == 0]) if len(pages) else 0

    def whole_free_slabs(self) -> np.ndarray:
        """Per group: owned slabs whose pages are all free (cached or not)."""
        return self.index.whole_counts()

    def spare_slabs(self, demands: dict[int, int], touched: np.ndarray | None = None) -> int:
        """Slabs left over once the free pages `touched` (a hit's) are taken and each group `g` got
        `demands[g]` free pages more (its free pages in slabs it still uses first, then whole slabs);
        negative when they do not fit."""
        group_free = self.group_free
        whole = self.index.whole_counts()
        if touched is not None and len(touched):
            touched = np.asarray(touched, dtype=np.int64)
            touched = touched[self.ref_counts[touched] == 0]
            groups = self.group_of(touched)
            slabs = np.unique(self.slab_of(touched, groups))  # free pages lie in slabs their group owns
            ending = slabs[self.slab_held[slabs] == 0]  # whole free slabs the hit would hold a page of
            whole = whole - np.bincount(self.slab_owner[ending], minlength=len(whole))
            group_free = group_free - np.bincount(groups, minlength=len(group_free))
        needed = 0
        for group, count in demands.items():
            if count <= 0:
                continue
            k = int(self.pages_per_slab[group])
            partial = int(group_free[group]) - int(whole[group]) * k
            needed += max(0, -(-(count - partial) // k))
        return self.num_unowned + int(whole.sum()) - needed

    def can_take(self, demands: dict[int, int], touched: np.ndarray | None = None) -> bool:
        """Whether each group `g` can get `demands[g]` free pages at once (slabs counted whole), after
        the free pages among `touched` (a hit's cached pages) were taken."""
        return self.spare_slabs(demands, touched) >= 0

    # -- reference counts -------------------------------------------------------------------------
    def touch(self, pages: np.ndarray) -> None:
        if len(pages):
            pages = np.asarray(pages, dtype=np.int64)
            leaving = pages[self.ref_counts[pages] == 0]
            self.index.taken(leaving)
            super().touch(pages)
            self._held_changed(leaving, +1)  # after: the index reads which pages are free
            return
        super().touch(pages)

    def release(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        pages = pages[pages != NULL_PAGE]
        before = self.ref_counts[pages].copy() if len(pages) else None
        super().release(pages)
        if len(pages):
            freed = pages[before == 1]
            self.free_stamp[freed] = np.arange(self._stamp, self._stamp + len(freed))
            self._stamp += len(freed)
            self.index.freed(freed, relist=False)
            self._held_changed(freed, -1)  # relists their slabs

    def _held_changed(self, pages: np.ndarray, sign: int) -> None:
        """`pages` went from free to held (+1) or back (-1)."""
        if not len(pages):
            return
        groups = self.group_of(pages)
        slabs = self.slab_of(pages, groups)
        distinct = np.unique(slabs)
        before = self.slab_held[distinct]
        np.add.at(self.slab_held, slabs, sign)
        np.subtract.at(self.group_free, groups, sign)
        self.index.held_changed(distinct, before)

    # -- cached blocks of free pages (the index counts them apart) ---------------------------------
    def cache_page(self, page: int, group: int, block_hash, parent, tokens=None) -> bool:
        if not super().cache_page(page, group, block_hash, parent, tokens):
            return False
        if self.ref_counts[page] == 0:
            self.index.cached_changed(page, group, True)
        return True

    def cache_pages(self, pages: list[int], group: int, hashes: list, parents: list) -> None:
        if pages and (self.ref_counts[pages] == 0).any():  # page by page, so each free one is counted
            for page, block_hash, parent in zip(pages, hashes, parents):
                self.cache_page(page, group, block_hash, parent)
            return
        super().cache_pages(pages, group, hashes, parents)

    def _evict_many(self, pages: list[int], hashes: list, groups: list[int]) -> None:
        free = [(page, group) for page, group in zip(pages, groups) if self.ref_counts[page] == 0]
        super()._evict_many(pages, hashes, groups)
        for page, group in free:
            self.index.cached_changed(page, group, False)

    def _evict(self, page: int, count: bool = True) -> None:
        group = int(self.page_group[page])
        super()._evict(page, count)
        if self.ref_counts[page] == 0:
            self.index.cached_changed(page, group, False)

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, count: int, evicted: list | None = None, group: int | None = None,
                 moves: list | None = None) -> np.ndarray:
        """Take `count` free pages of `group` (reference count 1), converting slabs as the module
        docstring says; `evicted` as `BlockPool.allocate`, `moves` gets each slab conversion (undo)."""
        if group is None:
            raise OutOfPagesError("a slab pool allocates the pages of one group at a time; pass group=")
        counts = [0] * len(self.pages_per_slab)
        counts[group] = count
        return self._take(counts, evicted, moves)[0][group]

    def _take(self, counts: list[int], evicted: list | None, moves: list | None
              ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """First every slab conversion the groups need (and those they prefer while slabs are spare),
        then each group's pages from its own free pages, so no group's pages break the whole free slab
        another group of the same admission counted on: (pages per group, their free-order positions)."""
        self.version += 1
        spare = [self.spare_slabs(dict(enumerate(counts)))]
        if spare[0] < 0:
            raise OutOfPagesError(f"need {counts} free KV pages per group; the pool cannot free them")
        for group, count in enumerate(counts):
            if count:
                self._make_room(group, count, evicted, moves, spare, counts)
        pages, positions = [], []
        for group, count in enumerate(counts):
            pages.append(self._pop(group, count, evicted))
            positions.append(self._last_positions if count else None)
        return pages, positions

    def _make_room(self, group: int, count: int, evicted: list | None, moves: list | None,
                   spare: list[int], counts: list[int]) -> None:
        """Convert slabs until `group` has `count` free pages (`counts`: what every group of this
        admission needs: their slabs are not taken from under them)."""
        k = int(self.pages_per_slab[group])
        if self.num_unowned:  # rather a free slab than an eviction of this group's cached pages
            empty = self._empty_free(group)
            while empty < count and self.num_unowned and (spare[0] > 0 or self.group_free[group] < count):
                if self.group_free[group] >= count:
                    spare[0] -= 1
                self.convert_slab(self.index.first_unowned(), group, evicted, moves)
                empty += k
        while self.group_free[group] < count:
            self.convert_slab(reclaimable(self, group, counts), group, evicted, moves)
        if not self.num_unowned:
            take_older_slabs(self, group, count, evicted, moves, spare, counts)

    def _pop(self, group: int, count: int, evicted: list | None) -> np.ndarray:
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        start, stop = self.group_range(group)
        order = self.eviction_order
        if self.bounded[group]:
            pages = densest_free(self, group, count)
            self._last_positions = order.positions(pages)
            forget = getattr(order, "on_reclaimed", None)
            if forget is not None:
                forget(pages)
            return self._took(pages, evicted)
        empty = min(count, self._empty_free(group)) if self.num_unowned else 0
        parts, positions = [], []
        if empty:  # free memory is left: take pages that hold nothing before evicting a cached block
            parts.append(order.pop_victims(empty, allowed=(start, stop), page_group=self.page_group))
            positions.append(order.victim_positions())
        if count > empty:
            parts.append(order.pop_victims(count - empty, allowed=(start, stop)))
            positions.append(order.victim_positions())
        pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._last_positions = positions[0] if len(positions) == 1 else np.concatenate(positions)
        return self._took(pages, evicted)

    def _took(self, pages: np.ndarray, evicted: list | None) -> np.ndarray:
        count = len(pages)
        self.index.taken(pages.astype(np.int64))
        self.ref_counts[pages] = 1
        self.num_free -= count
        self._held_changed(pages.astype(np.int64), +1)
        page_hash = self.page_hash
        evicting = [page for page in pages.tolist() if page_hash[page] is not None]
        if evicting:
            self._record_and_evict(evicting, evicted)
        return pages

    def _empty_free(self, group: int) -> int:
        return int(self.group_free[group]) - self.index.num_cached_free(group)

    def convert_slab(self, slab: int, group: int, evicted: list | None, moves: list | None) -> None:
        """Give `slab` (free, or wholly free in another group) to `group`; its cached blocks are evicted."""
        old = int(self.slab_owner[slab])
        old_pages, positions, blocks = np.zeros(0, dtype=np.int64), None, []
        if old >= 0:
            old_pages = self.slab_pages(slab, old)
            positions = self.eviction_order.positions(old_pages)
            self.index.taken(old_pages)
            self.ref_counts[old_pages] = 1
            cached = [page for page in old_pages.tolist() if self.page_hash[page] is not None]
            if cached:  # kept with the move (not in `evicted`: the new group may take the same ids)
                self._record_and_evict(cached, blocks)
            forget = getattr(self.eviction_order, "on_reclaimed", None)
            if forget is not None:
                forget(old_pages)
            self.group_free[old] -= len(old_pages)
            self.num_free -= len(old_pages)
            self.slab_trades += 1
        else:
            self.num_unowned -= 1
        new_pages = self.slab_pages(slab, group)
        self.ref_counts[new_pages] = 0
        self.group_free[group] += len(new_pages)
        self.num_free += len(new_pages)
        self.eviction_order.push_fresh(new_pages)
        self.slab_owner[slab] = group
        self.index.owner_changed(slab, old, group)
        self.index.freed(new_pages)
        self.slab_moves += 1
        if moves is not None:
            moves.append((slab, old, group, old_pages, positions, blocks))

    def undo_moves(self, moves: list) -> None:
        """Give converted slabs back (an admission rolled back): only slabs whose pages of the new group
        are all free and empty again; the old group's pages go back to their free positions with the
        blocks they held."""
        for slab, old, group, old_pages, positions, blocks in reversed(moves):
            held = {}
            for pages, hashes, groups, parents, tokens in blocks:
                for i, page in enumerate(pages):
                    held[page] = (groups[i], hashes[i], parents[i], tokens[i] if tokens else ())
            new_pages = self.slab_pages(slab, group)
            if (self.ref_counts[new_pages] != 0).any() or (self.page_group[new_pages] >= 0).any():
                continue
            self.version += 1
            self.index.taken(new_pages)
            self.ref_counts[new_pages] = 1
            self.group_free[group] -= len(new_pages)
            self.num_free -= len(new_pages)
            self.slab_owner[slab] = old
            self.index.owner_changed(slab, group, old)
            if old < 0:
                self.num_unowned += 1
                continue
            self.ref_counts[old_pages] = 0
            self.group_free[old] += len(old_pages)
            self.num_free += len(old_pages)
            self.index.freed(old_pages)
            for page in old_pages.tolist():
                if page in held:
                    group_id, block_hash, parent, tokens = held[page]
                    self.restore_cached(page, group_id, block_hash, parent, tokens)
            self.eviction_order.reinstate(old_pages, positions)

    def take(self, counts: list[int], evicted: list | None = None, moves: list | None = None
             ) -> tuple[list[list[int]], list[np.ndarray], list[np.ndarray]]:
        pages, positions = self._take(counts, evicted, moves)
        taken = [(p, q) for p, q in zip(pages, positions) if len(p)]
        return [p.tolist() for p in pages], [p for p, _ in taken], [q for _, q in taken]

    def allocate_pages(self, groups: Sequence[int]) -> np.ndarray:
        """One page for each entry of `groups` (a load's transfers), in that order."""
        groups = np.asarray(groups, dtype=np.int64)
        counts = np.bincount(groups, minlength=len(self.pages_per_slab)).tolist()
        pages, _ = self._take(counts, None, None)
        out = np.zeros(len(groups), dtype=np.int32)
        for group, taken in enumerate(pages):
            out[groups == group] = taken
        return out

    # -- accounting --------------------------------------------------------------------------------
    def group_usage(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per group: (slabs owned, pages held by requests, pages cached and free)."""
        owned = self.index.owned.copy()
        held = owned * self.pages_per_slab - self.group_free
        cached_free = np.asarray([self.index.num_cached_free(g) for g in range(len(owned))], dtype=np.int64)
        return owned, held, cached_free

    def map_held(self) -> np.ndarray:
        held = np.zeros(self.num_pages, dtype=np.int64)
        for group in range(len(self.pages_per_slab)):
            start, stop = self.group_range(group)
            slabs = (np.arange(start, stop) - start) // int(self.pages_per_slab[group])
            held[start:stop] = self.slab_owner[slabs] != group
        return held

    def check_invariants(self) -> None:
        super().check_invariants()
        for group in range(len(self.pages_per_slab)):
            start, stop = self.group_range(group)
            k = int(self.pages_per_slab[group])
            slabs = (np.arange(start, stop) - start) // k
            mine = self.slab_owner[slabs] == group
            refs = self.ref_counts[start:stop]
            assert (refs[~mine] >= 1).all(), f"group {group} has free ids in slabs it does not own"
            assert int(np.count_nonzero(mine & (refs == 0))) == self.group_free[group], group
        for slab in np.flatnonzero(self.slab_owner >= 0).tolist():
            owner = int(self.slab_owner[slab])
            held = int(np.count_nonzero(self.ref_counts[self.slab_pages(slab, owner)] > 0))
            assert held == self.slab_held[slab], (slab, held, int(self.slab_held[slab]))
        assert self.num_unowned == int(np.count_nonzero(self.slab_owner == FREE_SLAB))
        check_index(self)
