"""The group-restricted path of the LRU and pinned eviction orders (agentjax/kv/eviction.py, pinned_order.py).

A "pool" KV layout (agentjax/kv/slab_pool.py) gives each page group its own range of page ids and
takes victims of one group at a time: `pop_in_range` takes the first live entries inside `[lo, hi)`
and leaves the other groups' entries where they are. Pages of a slab newly given to a group go to the
front of the queue (`push_fresh`: they hold nothing). Host only: never imports jax.
"""
from __future__ import annotations

import heapq

import numpy as np

from agentjax.errors import OutOfPagesError


def pop_in_range(order, count: int, lo: int, hi: int, page_group: np.ndarray | None = None) -> np.ndarray:
    """`LRUEvictionOrder.pop_victims` (or `PinnedEvictionOrder`'s) restricted to pages in `[lo, hi)`;
    with `page_group` (the pool's: -1 where a page holds no block), to pages that hold nothing. Pinned
    free pages met on the way move to the pinned tier whatever their group; pinned pages are taken last."""
    table = getattr(order, "pins", None)
    if table is not None:
        order._last_from_tier = None
        table.expire()
    pins = table is not None and table.active
    taken: list[np.ndarray] = []
    need, position, keep_from = count, order._head, None
    while need > 0 and position < order._tail:
        end = min(order._tail, position + max(2 * need, 64))
        pages = order._queue_pages[position:end]
        stamps = order._queue_stamps[position:end]
        live = (order._ref_counts[pages] == 0) & (order._page_stamp[pages] == stamps)
        pinned = live & (table.count[pages] > 0) if pins else np.zeros(len(pages), dtype=bool)
        eligible = live & ~pinned & (pages >= lo) & (pages < hi)
        if page_group is not None:
            eligible &= page_group[pages] < 0
        chosen = np.flatnonzero(eligible)[:need]
        cut = int(chosen[-1]) + 1 if len(chosen) == need else len(pages)
        moved = np.flatnonzero(pinned[:cut])
        if len(moved):
            order._to_tier(pages[moved].copy(), stamps[moved].copy())
        staying = live[:cut] & ~pinned[:cut]
        staying[chosen] = False
        if keep_from is None and staying.any():
            keep_from = position + int(np.flatnonzero(staying)[0])
        taken.append(pages[chosen].copy())
        need -= len(chosen)
        position += cut
    order._head = keep_from if keep_from is not None else position
    from_tier: list[int] = []
    if need > 0 and pins:  # pinned pages last (with `page_group`: empty ones, which a pin keeps nothing in)
        aside = []
        while need > 0 and order._tier:
            entry = heapq.heappop(order._tier)
            _, stamp, page, sequence = entry
            if not order._tier_entry_live(stamp, page, sequence):
                continue
            if lo <= page < hi and (page_group is None or page_group[page] < 0):
                order._in_tier[page] = False
                from_tier.append(page)
                need -= 1
            else:
                aside.append(entry)
        for entry in aside:
            heapq.heappush(order._tier, entry)
    if need > 0:
        raise OutOfPagesError(f"eviction order holds {count - need} free pages in [{lo}, {hi}), {count} requested")
    if from_tier:
        order._finish_victims(taken, from_tier)
    else:
        order._last_victims = np.concatenate(taken) if len(taken) != 1 else taken[0]
    order._last_victims = order._last_victims.astype(np.int32)
    return order._last_victims


def fresh_stamps(order, count: int) -> np.ndarray:
    """Stamps below every stamp handed out so far: entries that go before the whole queue."""
    low = getattr(order, "_next_fresh", 0)
    order._next_fresh = low - count
    return np.arange(low - count, low, dtype=np.int64)
