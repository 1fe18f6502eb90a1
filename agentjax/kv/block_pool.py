"""The fixed pool of KV pages: reference counts, the reserved null page, the cached-page index and
the free queue whose order decides eviction.

Freed pages that still hold a hash stay hittable until a new allocation reuses them. The eviction
order is a small protocol (`agentjax.kv.eviction`): plain LRU, or LRU then session / branch pins
(`PinnedEvictionOrder`, the default), or a cost-aware score, plug in without touching the pool.
Host only: never imports jax.
"""
from __future__ import annotations

from operator import itemgetter

import numpy as np

from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.kv.events import BlockRemoved, BlockStored, KVEvent
from agentjax.kv.eviction import NULL_PAGE, EvictionOrder
from agentjax.kv.pinned_order import PinnedEvictionOrder
from agentjax.kv.hashing import BlockHash

__all__ = ["NULL_PAGE", "BlockPool"]


class BlockPool:
    """`num_pages` pages of one byte size; page 0 is the null page and is never handed out.

    `cached[group][hash]` maps a group's block hash to the page that holds it; the group id is
    thus part of the lookup key. Events (`BlockStored`, `BlockRemoved`) are recorded when enabled.
    """

    num_groups_share_ids = True  # any page id serves any group (a SlabPool's ids belong to one group)

    def __init__(self, num_pages: int, num_groups: int = 1, eviction_order: EvictionOrder | None = None,
                 enable_events: bool = False):
        if num_pages < 2:
            raise InvalidRequestError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        self.ref_counts[NULL_PAGE] = 1  # never free, never evicted
        self.page_hash: list[BlockHash | None] = [None] * num_pages
        self.page_group = np.full(num_pages, -1, dtype=np.int16)
        self.page_parent: list[BlockHash | None] = [None] * num_pages  # to re-announce an undone eviction
        self.page_tokens: list[tuple[int, ...]] = [()] * num_pages  # the same, kept when events are on
        self.cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self.eviction_order = eviction_order or PinnedEvictionOrder()
        self.eviction_order.bind(self.ref_counts)
        bind_pool = getattr(self.eviction_order, "bind_pool", None)
        if bind_pool is not None:  # an order that reads the pool (e.g. PolicyEvictionOrder: empty pages first)
            bind_pool(self)
        self.eviction_order.push_free(np.arange(1, num_pages, dtype=np.int32))
        self.num_free = num_pages - 1
        self.num_cached = 0
        self.evictions = 0
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.version = 0  # bumped by every change that can alter a lookup or an allocation
        # Index entries change only by unmapping: `page_unmapped_at[p]` is the `unmap_count` at the
        # last unmapping of page p, so a run of pages read at count c is still mapped if none exceeds c.
        self.unmap_count = 0
        self.page_unmapped_at = np.zeros(num_pages, dtype=np.int64)

    # -- queries -------------------------------------------------------------------------------
    def cached_page(self, group: int, block_hash: BlockHash) -> int | None:
        return self.cached[group].get(block_hash)

    def count_free_among(self, pages: np.ndarray) -> int:
        """How many of `pages` are free (hits on them take them out of the free count)."""
        return int(np.count_nonzero(self.ref_counts[pages] == 0)) if len(pages) else 0

    # -- capacity in units (one page here; a "pool" layout's SlabPool weighs pages by size) --------
    def free_units(self) -> int:
        return self.num_free

    def capacity_units(self) -> int:
        return self.num_pages - 1

    def page_units(self, pages, by_group: bool = False) -> int:
        """Units of `pages` (with `by_group`: of one page of each group listed)."""
        return len(pages)

    def count_units(self, count: int) -> int:
        """At most how many units `count` pages of unknown groups weigh."""
        return count

    def free_units_among(self, pages: np.ndarray) -> int:
        return self.count_free_among(pages)

    def can_take(self, demands: dict[int, int], touched: np.ndarray | None = None) -> bool:
        """Whether `demands[group]` free pages can be taken for every group at once, after the free
        pages among `touched` (a hit's cached pages) were taken."""
        extra = self.count_free_among(np.asarray(touched, dtype=np.int64)) if touched is not None else 0
        return sum(demands.values()) + extra <= self.num_free

    def take(self, counts: list[int], evicted: list | None = None, moves: list | None = None
             ) -> tuple[list[list[int]], list[np.ndarray], list[np.ndarray]]:
        """`counts[g]` new pages for each group g: (pages per group, the arrays taken and the free-order
        positions they held, for an undo record). Here one allocation serves every group."""
        total = sum(counts)
        pages = self.allocate(total, evicted)
        positions = self.eviction_order.victim_positions() if total else None
        flat, out, start = pages.tolist(), [], 0
        for count in counts:
            out.append(flat[start:start + count])
            start += count
        return out, ([pages] if total else []), ([positions] if total else [])

    def allocate_pages(self, groups) -> np.ndarray:
        """One page for each entry of `groups` (a load's transfers), in that order."""
        return self.allocate(len(groups))

    # -- mutations -----------------------------------------------------------------------------
    def touch(self, pages: np.ndarray) -> None:
        """Take a reference on each of the distinct cached `pages` (a prefix hit)."""
        self.version += 1
        if len(pages) == 0:
            return
        refs = self.ref_counts[pages]
        self.num_free -= int(np.count_nonzero(refs == 0))
        self.ref_counts[pages] = refs + 1

    def allocate(self, count: int, evicted: list | None = None, group: int | None = None,
                 moves: list | None = None) -> np.ndarray:
        """Take `count` free pages (reference count 1), evicting their cached hashes; with `evicted`,
        append one batch (pages, hashes, groups, parents, tokens) of what was evicted (an undo record).
        Every page id serves every group here, so `group` and `moves` (SlabPool's) are not needed."""
        self.version += 1
        if count > self.num_free:
            raise OutOfPagesError(f"need {count} free KV pages, only {self.num_free} free")
        if count == 0:
            return np.zeros(0, dtype=np.int32)
        pages = self.eviction_order.pop_victims(count)
        self.ref_counts[pages] = 1
        self.num_free -= count
        page_hash = self.page_hash
        evicting = [page for page in pages.tolist() if page_hash[page] is not None]
        if evicting:
            self._record_and_evict(evicting, evicted)
        return pages

    def _record_and_evict(self, pages: list[int], evicted: list | None) -> None:
        """Evict `pages`' cached hashes; with `evicted`, append their undo record (see `allocate`)."""
        hashes = [self.page_hash[page] for page in pages]
        groups = self.page_group[pages].tolist()
        if evicted is not None:
            parents = [self.page_parent[page] for page in pages]
            tokens = [self.page_tokens[page] for page in pages] if self.enable_events else None
            evicted.append((pages, hashes, groups, parents, tokens))
        self._evict_many(pages, hashes, groups)

    def _evict_many(self, pages: list[int], hashes: list[BlockHash], groups: list[int]) -> None:
        if len(self.cached) == 1:
            index = self.cached[0]
            for block_hash in hashes:
                del index[block_hash]
        else:
            cached = self.cached
            for block_hash, group in zip(hashes, groups):
                del cached[group][block_hash]
        page_hash = self.page_hash
        for page in pages:
            page_hash[page] = None
        self.page_group[pages] = -1
        self.unmap_count += 1
        self.page_unmapped_at[pages] = self.unmap_count
        self.num_cached -= len(pages)
        self.evictions += len(pages)
        if self.enable_events:
            self.events.extend(map(BlockRemoved, hashes, groups))

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
        self.page_parent[page] = parent
        self.num_cached += 1
        if self.enable_events:
            self.page_tokens[page] = tokens or ()
            self.events.append(BlockStored(block_hash, parent, tokens or (), group))
        return True

    def cache_pages(self, pages: list[int], group: int, hashes: list[BlockHash], parents: list) -> None:
        """`cache_page` for consecutive pages of one group (events off): when none of `hashes` is cached
        and none of `pages` holds a hash, in a few C calls; else page by page (first come is kept)."""
        index, page_hash = self.cached[group], self.page_hash
        held = itemgetter(*pages)(page_hash) if len(pages) > 1 else (page_hash[pages[0]],) if pages else ()
        if self.enable_events or any(map(index.__contains__, hashes)) or held.count(None) != len(pages):
            for page, block_hash, parent in zip(pages, hashes, parents):
                self.cache_page(page, group, block_hash, parent)
            return
        self.version += 1
        index.update(zip(hashes, pages))
        page_parent = self.page_parent
        for page, block_hash, parent in zip(pages, hashes, parents):
            page_hash[page] = block_hash
            page_parent[page] = parent
        self.page_group[pages] = group
        self.num_cached += len(pages)

    # -- undo of an admission (see KVCacheManager) -------------------------------------------------
    def uncache(self, page: int) -> bool:
        """Make `page` unhittable without counting an eviction (its hash came from an undone admission)."""
        self.version += 1
        if self.page_hash[page] is None:
            return False
        self._evict(page, count=False)
        return True

    def restore_cached(self, page: int, group: int, block_hash: BlockHash, parent: BlockHash | None,
                       tokens: tuple[int, ...]) -> bool:
        """Undo the eviction of (group, hash) from `page`; False if that block is cached elsewhere now."""
        if not self.cache_page(page, group, block_hash, parent, tokens):
            return False
        self.evictions -= 1
        return True

    def restore_free(self, pages: np.ndarray, positions: np.ndarray) -> None:
        """Pages among `pages` whose reference count is 0 go back to where `positions` says they sat."""
        if len(pages) == 0:
            return
        self.version += 1
        free = self.ref_counts[pages] == 0
        if free.any():
            self.eviction_order.reinstate(pages[free], positions[free])

    def evict(self, page: int) -> bool:
        """Make a cached page unhittable now (an operator reset, or a tier that moved it); False if
        it held no hash. The page itself stays with its owners or in the free queue."""
        self.version += 1
        if self.page_hash[page] is None:
            return False
        self._evict(page)
        return True

    def _evict(self, page: int, count: bool = True) -> None:
        block_hash = self.page_hash[page]
        group = int(self.page_group[page])
        del self.cached[group][block_hash]
        self.page_hash[page] = None
        self.page_group[page] = -1
        self.unmap_count += 1
        self.page_unmapped_at[page] = self.unmap_count
        emptied = getattr(self.eviction_order, "page_emptied", None)
        if emptied is not None:  # it may be a free page: an eviction order that takes empty pages first
            emptied(page)
        self.num_cached -= 1
        self.evictions += count
        if self.enable_events:
            self.events.append(BlockRemoved(block_hash, group))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def map_held(self) -> np.ndarray:
        """References per page that no request holds (a SlabPool's slab map holds the ids of slabs their
        group does not own)."""
        return np.zeros(self.num_pages, dtype=np.int64)

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
