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
    ones. Each allocation scans the free pages once in numpy (O(free pages), no per-page Python).
    The manager's `pin_request` / `pin_prefix` / `unpin` reach the policy's pins through `pin`.
    """

    def __init__(self, policy: PagePolicy):
        self.policy = policy
        self.clock = policy.clock
        self._ref_counts = np.zeros(0, dtype=np.int32)
        self._page_group: np.ndarray | None = None
        self._pool = None
        self._last_state = np.zeros((0, len(PagePolicy._STATE_FIELDS)), dtype=np.int64)

    def bind(self, pool_ref_counts: np.ndarray) -> None:
        self._ref_counts = pool_ref_counts
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

    def pop_victims(self, count: int, allowed: tuple[int, int] | None = None,
                    page_group: np.ndarray | None = None) -> np.ndarray:
        """`page_group` is accepted for the protocol: empty pages are taken first anyway. On a pool
        that indexes one group's free pages (a `SlabPool`'s `index`), they are read from there."""
        index = getattr(self._pool, "index", None)
        if allowed is not None and index is not None:
            return self._pop_indexed(index, count, allowed)
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
        victims = victims.astype(np.int32)
        self._last_state = self.policy.page_state(victims)
        self.policy.on_evict(victims)
        return victims

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
