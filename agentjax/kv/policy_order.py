"""The bridge from a KV policy (`agentjax.kv.policy`) to the block pool's `EvictionOrder` protocol.

`PolicyEvictionOrder(policy)` is what `KVCacheManager(..., eviction_order=...)` takes: it reports
frees and evictions to the policy, asks it which cached free pages to take, keeps the undo record
of an admission, and passes the manager's pins through. Host only: never imports jax.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import numpy as np

from agentjax.errors import OutOfPagesError
from agentjax.kv.policy import PagePolicy

__all__ = ["PolicyEvictionOrder", "engine_eviction_order"]


def engine_eviction_order(kv_policy: str, clock: Callable[[], float] = time.monotonic) -> "PolicyEvictionOrder":
    """The eviction order of an engine whose `kv_policy` setting is `kv_policy` (see `engine_policy`)."""
    from agentjax.kv.policies import engine_policy

    return PolicyEvictionOrder(engine_policy(kv_policy, clock))


class PolicyEvictionOrder:
    """An `EvictionOrder` (agentjax.kv.eviction) that asks a `KVPolicy` which free pages to take.

    Free pages that hold no cached block go first (nothing is lost); the policy orders the cached
    ones. Empty free pages are read from a cursor below which there is none; only when they run out does
    an allocation scan the free pages (O(free pages) in numpy, no per-page Python).
    The manager's `pin_request` / `pin_prefix` / `unpin` reach the policy's pins through `pin`.
    """

    def __init__(self, policy: PagePolicy):
        self.policy = policy
        self.clock = policy.clock
        self._ref_counts = np.zeros(0, dtype=np.int32)
        self._page_group: np.ndarray | None = None
        self._pool = None
        self._last_state = np.zeros((0, len(PagePolicy._STATE_FIELDS)), dtype=np.int64)
        self._cursor = 0  # no free page without a cached block lies below it (`_empty_from_cursor`)

    def bind(self, pool_ref_counts: np.ndarray) -> None:
        self._ref_counts = pool_ref_counts
        self._cursor = 0
        self.policy.bind(len(pool_ref_counts))

    def bind_pool(self, pool) -> None:
        """The pool's group per page (-1: no cached block), read to take empty pages first."""
        self._pool = pool
        self._page_group = pool.page_group

    def evict_cached_beyond(self, max_cached: int) -> int:
        """Evict cached free pages in the policy's order until at most `max_cached` pages hold cached
        blocks (a cache capacity below the pool's size, the rest being room for running requests);
        returns how many it evicted. The pages stay free, now empty, so they are reused first."""
        pool = self._pool
        excess = pool.num_cached - max_cached
        if excess <= 0:
            return 0
        cached_free = np.flatnonzero((self._ref_counts == 0) & (self._page_group >= 0))
        victims = self.policy.evict_order(cached_free, excess)
        for page in victims.tolist():
            pool.evict(page)
        self.policy.on_evict(victims)
        return len(victims)

    def push_free(self, pages: np.ndarray) -> None:
        if len(pages):
            self.policy.on_free(np.asarray(pages, dtype=np.int64))
            self._lower_cursor(pages)

    def pop_victims(self, count: int, allowed: tuple[int, int] | None = None,
                    page_group: np.ndarray | None = None) -> np.ndarray:
        """`page_group` is accepted for the protocol: empty pages are taken first anyway. On a pool
        that indexes one group's free pages (a `SlabPool`'s `index`), they are read from there."""
        index = getattr(self._pool, "index", None)
        if allowed is not None and index is not None:
            return self._pop_indexed(index, count, allowed)
        if allowed is None and index is None and self._page_group is not None:
            empty = self._empty_from_cursor(count)
            if len(empty) == count:
                return self._victims(empty)
            # every empty free page is in `empty`: the rest are cached free pages, in the policy's order
            free = np.flatnonzero(self._ref_counts == 0)
            cached = free[self._page_group[free] >= 0]
            if len(empty) + len(cached) < count:
                self._lower_cursor(empty)  # not taken after all
                raise OutOfPagesError(f"eviction order holds {len(empty) + len(cached)} free pages, {count} requested")
            return self._victims(np.concatenate([empty, self.policy.evict_order(cached, count - len(empty))]))
        if allowed is None:
            free = np.flatnonzero(self._ref_counts == 0)
        else:  # one page group's ids (a "pool" KV layout, agentjax/kv/slab_pool.py)
            free = allowed[0] + np.flatnonzero(self._ref_counts[allowed[0]:allowed[1]] == 0)
        if len(free) < count:
            raise OutOfPagesError(f"eviction order holds {len(free)} free pages, {count} requested")
        if self._page_group is None:
            victims = self.policy.evict_order(free, count)
        else:
            empty = self._page_group[free] < 0
            victims = free[empty][:count]
            if len(victims) < count:
                victims = np.concatenate([victims, self.policy.evict_order(free[~empty], count - len(victims))])
        return self._victims(victims)

    def _victims(self, victims: np.ndarray) -> np.ndarray:
        victims = victims.astype(np.int32)
        self._last_state = self.policy.page_state(victims)
        self.policy.on_evict(victims)
        return victims

    def _empty_from_cursor(self, count: int) -> np.ndarray:
        """Up to `count` free pages that hold no cached block, lowest id first, read from `_cursor` on in
        chunks that double: no such page lies below the cursor (`_lower_cursor` keeps it so), so a pool
        with empty pages left costs O(pages read past the cursor), not O(pool), per allocation."""
        refs, groups = self._ref_counts, self._page_group
        found: list[np.ndarray] = []
        start, need, chunk = self._cursor, count, max(4096, 2 * count)
        while need and start < len(refs):
            stop = min(len(refs), start + chunk)
            hits = start + np.flatnonzero((refs[start:stop] == 0) & (groups[start:stop] < 0))
            if len(hits) >= need:
                found.append(hits[:need])
                self._cursor = int(hits[need - 1]) + 1
                need = 0
                break
            found.append(hits)
            need -= len(hits)
            start, chunk = stop, 2 * chunk
        if need:
            self._cursor = len(refs)  # none left past the cursor
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _lower_cursor(self, pages: np.ndarray) -> None:
        """`pages` may now be free and empty: the cursor moves down to the lowest of them."""
        if len(pages):
            self._cursor = min(self._cursor, int(np.min(pages)))

    def page_emptied(self, page: int) -> None:
        """The pool dropped `page`'s cached block while the page stays where it is (maybe free)."""
        self._cursor = min(self._cursor, page)

    def _pop_indexed(self, index, count: int, allowed: tuple[int, int]) -> np.ndarray:
        """`pop_victims` over the group whose ids are `allowed`: its empty free pages lowest id first,
        then its cached free pages in the policy's order (O(count); once no empty page is left, the
        policy scores every cached free page of the group, as it does on one page-id space)."""
        group = int(self._pool.group_of(np.asarray([allowed[0]], dtype=np.int64))[0])
        free = int(self._pool.group_free[group])
        if free < count:
            raise OutOfPagesError(f"eviction order holds {free} free pages, {count} requested")
        victims = np.asarray(index.pop_empty(group, count), dtype=np.int64)
        if len(victims) < count:
            cached = index.cached_free_sorted(group)
            victims = np.concatenate([victims, self.policy.evict_order(cached, count - len(victims))])
        victims = victims.astype(np.int32)
        self._last_state = self.policy.page_state(victims)
        self.policy.on_evict(victims)
        return victims

    def push_fresh(self, pages: np.ndarray) -> None:
        """Pages of a slab given to another group: empty, so taken first (`pop_victims` takes empty pages
        before cached ones)."""
        self.push_free(pages)

    def on_reclaimed(self, pages: np.ndarray) -> None:
        """Free pages whose slab went to another group: evicted for the policy (their pins end)."""
        self.policy.on_evict(np.asarray(pages, dtype=np.int64))

    def pinned_mask(self, pages: np.ndarray) -> np.ndarray:
        return self.policy.pins.pinned_mask(pages)

    # -- undo (a rolled-back admission) ------------------------------------------------------------
    def positions(self, pages: np.ndarray) -> np.ndarray:
        return self.policy.page_state(np.asarray(pages, dtype=np.int64))

    def victim_positions(self) -> np.ndarray:
        return self._last_state

    def reinstate(self, pages: np.ndarray, positions: np.ndarray) -> None:
        self._lower_cursor(pages)
        if len(pages):
            self.policy.restore_page_state(np.asarray(pages, dtype=np.int64), positions)

    # -- pins, as the manager calls them -----------------------------------------------------------
    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        return self.policy.pin(key, pages, expires_at)

    def unpin(self, key: Hashable) -> int:
        return self.policy.unpin(key)

    def num_pinned(self) -> tuple[int, int]:
        return self.policy.pins.num_pinned(self._ref_counts)

    @property
    def pins(self):
        """The policy's pin table (agentjax/kv/pins.py)."""
        return self.policy.pins

    @property
    def pinned_evictions(self) -> int:
        return self.policy.pinned_evictions
