"""The KV manager's capacity reads, stats, and the page holds of the offload tiers' loads (mixed into
`agentjax.kv.manager.KVCacheManager`).

The group reads (`prefix_group`, `hashes_per_page`, `page_table_lengths`) answer from the public plan
and each group's own page rule, so callers never hold the manager's group managers.
Capacity is counted in the pool's units (pages for a one-size pool, page units for a slab pool).
A load from an offload tier holds device pages outside any request: `hold_pages` / `take_load_pages`
reserve them, `cache_loaded_page` makes a loaded page an ordinary cached page, `release_pages` lets
them go. Nothing here admits, grows or frees a request (the scheduler does). Host only: never imports jax.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentjax.kv.block_pool import NULL_PAGE
from agentjax.kv.hashing import BlockHash
from agentjax.kv.specs import KVGroup

__all__ = ["CapacityReadsMixin"]


class CapacityReadsMixin:
    """`KVCacheManager` methods that read capacity and stats and hold pages for loads (see the module docstring)."""

    @property
    def num_pages(self) -> int:
        """Page ids of the pool, the null page 0 included (the device's KV buffers hold this many)."""
        return self.pool.num_pages

    @property
    def units_are_pages(self) -> bool:
        """Whether capacity counts pages (every group's pages share one id space) rather than page units."""
        return bool(self.pool.num_groups_share_ids)

    def prefix_group(self) -> KVGroup | None:
        """The first group whose hits are prefix runs (full attention, MLA latents): the group that keeps
        a whole context and routes requests by their page keys; None for a model without one."""
        return next((group for group in self.plan.groups if group.spec.hit_rule == "prefix"), None)

    def hashes_per_page(self, group: int) -> int:
        """Prefix hashes (of `block_size` tokens each) one page of `group` spans; its page key is the last."""
        return self.plan.groups[group].tokens_per_page // self.block_size

    def page_table_lengths(self, num_tokens: int) -> tuple[int, ...]:
        """Each group's page-table length for a row of `num_tokens` tokens, by that group's own rule (a
        recurrent-state group: its running page)."""
        return tuple(len(group.build_table(0, [], [NULL_PAGE] * group.num_new_pages(0, 0, num_tokens)).pages)
                     for group in self.groups)

    def holds_block(self, pages: np.ndarray) -> np.ndarray:
        """Per page of `pages`: whether it holds a cached block (of any group)."""
        return self.pool.page_group[pages] >= 0

    def enable_events(self) -> None:
        """Record `BlockStored` / `BlockRemoved` events from now on, for `take_events`."""
        self.pool.enable_events = True

    def evict_free_pages(self) -> int:
        """Evict every cached page no request holds (a benchmark's cold device cache); returns how many."""
        pool, evicted = self.pool, 0
        for page in np.flatnonzero(pool.ref_counts == 0).tolist():
            if page:
                evicted += bool(pool.evict(page))
        return evicted

    def cached_blocks_by_group(self) -> list[tuple[int, str, int]]:
        """(group id, KV kind, cached pages) per group."""
        return [(g.group_id, g.group.spec.kind, len(self.pool.cached[g.group_id])) for g in self.groups]

    def max_pages_for(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most pages one request of `num_tokens` tokens can hold at once over all groups (window
        groups hold the window plus one chunk; a state group its running page), in the pool's units (a
        slab pool's: whole slabs per group, as a request alone takes them)."""
        total = 0
        for group in self.groups:
            rule, size = group.group.spec.hit_rule, group.tokens_per_page
            if rule == "checkpoint":
                pages = 1
            elif rule == "window":
                pages = min(-(-num_tokens // size), -(-(group.window + max_chunk_tokens) // size) + 1)
            else:
                pages = -(-num_tokens // size)
            per_slab = getattr(self.pool, "pages_per_slab", None)
            if per_slab is None:
                total += pages
            else:
                total += -(-pages // int(per_slab[group.group_id])) * self.pool.units_per_slab
        return total

    def units_per_page(self, group: int) -> int:
        """A page of `group` in the pool's capacity units (1 unless pages differ in size by group)."""
        units = getattr(self.pool, "units_per_page", None)
        return 1 if units is None else int(units[group])

    def new_units(self, num_tokens: int, hit: int) -> int:
        """Units the prefix pages of a prompt of `num_tokens` tokens with a hit of `hit` tokens take
        (the scheduler's watermark estimate)."""
        if self.pool.num_groups_share_ids:
            return -(-num_tokens // self.block_size) - hit // self.block_size
        return sum((-(-num_tokens // g.tokens_per_page) - hit // g.tokens_per_page) * self.units_per_page(g.group_id)
                   for g in self.groups if g.group.spec.hit_rule == "prefix")

    @property
    def capacity_units(self) -> int:
        """What the pool can hold, in units (pages for a one-size pool)."""
        return self.pool.capacity_units()

    def take_events(self):
        return self.pool.take_events()

    @property
    def num_free_blocks(self) -> int:
        """Free capacity in the pool's units (pages for a one-size pool)."""
        return self.pool.free_units()

    def stats(self) -> dict:
        pool = self.pool
        pinned, pinned_free = pool.eviction_order.num_pinned() if hasattr(pool.eviction_order, "num_pinned") else (0, 0)
        capacity, free = pool.capacity_units(), pool.free_units()
        return {
            "num_blocks": capacity + 1, "free_blocks": free, "cached_blocks": pool.num_cached,
            "used_blocks": capacity - free, "queries": self.queries, "hits": self.hits,
            "hit_rate": self.hits / self.queries if self.queries else 0.0, "lookups": self.lookups,
            "evictions": pool.evictions, "running_requests": len(self._requests),
            "blocks_hashed": self._memo.blocks_hashed, "blocks_hash_reused": self._memo.blocks_reused,
            "rollbacks": self.rollbacks, "pinned_blocks": pinned, "pinned_free_blocks": pinned_free,
            "pinned_evictions": getattr(pool.eviction_order, "pinned_evictions", 0),
            "group_hits": list(self.group_hits), "turn_end_hits": self.turn_end_hits,
            "turn_ends_saved": self.turn_ends.saved if self.turn_ends is not None else 0,
            "branch_states_saved": self.branch_states_saved,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if page ownership and reference counts disagree (tests call this)."""
        self.pool.check_invariants()
        owners = np.zeros(self.pool.num_pages, dtype=np.int64)
        for request in self._requests.values():
            for table in request.tables:
                held = [p for p in table.pages if p != 0]
                assert len(held) == len(set(held)), f"{request.req_id} holds a page twice"
                np.add.at(owners, np.asarray(held, dtype=np.int64), 1)
        np.add.at(owners, np.asarray(self._pending_copy_sources, dtype=np.int64), 1)
        owners += self.pool.map_held()
        owners[0] = self.pool.ref_counts[0]
        mismatch = np.flatnonzero(owners != self.pool.ref_counts)
        assert mismatch.size == 0, f"ref counts differ from owners at pages {mismatch[:8].tolist()}"

    # -- pages held for a load from an offload tier ------------------------------------------------
    def load_units(self, groups: Sequence[int], resident: np.ndarray) -> int:
        """Free units a load takes: a new page of each of `groups` (one per transfer) and the `resident`
        cached pages of the hit it holds that are free now."""
        return self.pool.page_units(groups, by_group=True) + self.pool.free_units_among(resident)

    def pinned_free_units(self) -> int:
        """Free units the pins protect (a prefetch leaves them alone)."""
        order = self.pool.eviction_order
        pinned_free = order.num_pinned()[1] if hasattr(order, "num_pinned") else 0
        return self.pool.count_units(pinned_free)

    def hold_pages(self, pages: np.ndarray) -> None:
        """Take a reference on cached `pages` (a load's resident hit must outlive the load)."""
        self.pool.touch(pages)

    def take_load_pages(self, groups: Sequence[int]) -> np.ndarray:
        """One new page for each entry of `groups`, held, for a load's transfers (room checked by the caller)."""
        return self.pool.allocate_pages(groups)

    def cache_loaded_page(self, page: int, group: int, block_hash: BlockHash, parent: BlockHash | None) -> bool:
        """A loaded page holds `block_hash` of `group`: cache it (False if the block is cached already)."""
        return self.pool.cache_page(page, group, block_hash, parent)

    def release_pages(self, pages: np.ndarray) -> None:
        """Drop the references `hold_pages` / `take_load_pages` took."""
        self.pool.release(np.asarray(pages, dtype=np.int64))
