"""Which slab or page a `SlabPool` (agentjax/kv/slab_pool.py) takes next: the whole free slab another
group gives up first, the older of a group's own cached pages and another group's free slab, and where a
window or state group puts its new pages. Host only: never imports jax.
"""
from __future__ import annotations

import numpy as np

from agentjax.errors import OutOfPagesError


def densest_free(pool, group: int, count: int) -> np.ndarray:
    """`count` free pages of a bounded group, which the caller takes: unpinned first; while free slabs
    remain, empty before cached; then in the slabs with the most held pages (so the others drain whole
    and can change hands), then freed longest ago; then lowest id. Read from the pool's `SlabIndex`
    (O(count + pinned pages passed over) x log), not from the group's page range."""
    return pool.index.pop_dense(group, count, getattr(pool.eviction_order, "pinned_mask", None))


def reclaimable(pool, group: int, counts: list[int] | None = None, fallback: bool = True) -> int:
    """The whole free slab of another group to take first: without pins, then without cached blocks,
    then the one freed longest ago; never one that a group needs for its `counts` pages. Reads the
    other groups' whole free slabs only (the pool's `SlabIndex`), not every slab."""
    best, best_key = -1, None
    pinned = getattr(pool.eviction_order, "pinned_mask", None)
    for other in range(len(pool.pages_per_slab)):
        if other == group:
            continue
        if counts is not None and pool.group_free[other] - pool.pages_per_slab[other] < counts[other]:
            continue
        whole = pool.index.whole[other]
        if not whole:
            continue
        slabs = np.fromiter(sorted(whole), dtype=np.int64, count=len(whole))
        k = int(pool.pages_per_slab[other])
        ids = int(pool.bases[other]) + slabs[:, None] * k + np.arange(k)[None, :]
        keys = np.stack([pinned(ids).any(axis=1) if pinned is not None else np.zeros(len(slabs), bool),
                         (pool.page_group[ids] >= 0).any(axis=1), pool.free_stamp[ids].max(axis=1)], axis=1)
        first = np.lexsort(keys.T[::-1])[0]
        key = tuple(keys[first].tolist())
        if best_key is None or key < best_key:
            best, best_key = int(slabs[first]), key
    if best < 0:
        if counts is not None and fallback:
            return reclaimable(pool, group)
        raise OutOfPagesError(f"no slab can be given to KV group {group}")
    return best


def take_older_slabs(pool, group: int, count: int, evicted: list | None, moves: list | None,
                     spare: list[int], counts: list[int]) -> None:
    """Under pressure: while a whole free slab of another group was freed before the oldest cached
    free page of `group` and `group`'s empty pages do not cover `count`, take that slab instead
    (at most `spare[0]` slabs). Reads `group`'s oldest cached free page from the pool's `SlabIndex`."""
    cached = pool.index.cached_free[group]
    empty = int(pool.group_free[group]) - len(cached)
    if empty >= count or not cached:
        return
    oldest_own = pool.index.oldest_cached_stamp(group)
    while empty < count and spare[0] > 0:
        whole = pool.whole_free_slabs()
        if whole.sum() - whole[group] == 0:
            return
        try:
            slab = reclaimable(pool, group, counts, fallback=False)
        except OutOfPagesError:
            return
        owner = int(pool.slab_owner[slab])
        if int(pool.free_stamp[pool.slab_pages(slab, owner)].max()) >= oldest_own:
            return
        pool.convert_slab(slab, group, evicted, moves)
        spare[0] -= 1
        empty += int(pool.pages_per_slab[group])
