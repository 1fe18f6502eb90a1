"""Per-group page logic for the three prefix-hit rules: prefix, window and checkpoint.

Each group finds how much of a prefix it can serve (never more than it is asked), lists the cached
pages a hit reuses, sizes a request's block table and caches pages once their KV is written. The
hybrid manager composes them; a group never decides anything for another. Host only: never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentjax.kv.block_pool import NULL_PAGE, BlockPool
from agentjax.kv.hashing import BlockHash
from agentjax.kv.known_runs import KnownRuns
from agentjax.kv.specs import KVGroup


class PageList(list):
    """A table's page list copied from the one handed out before it (`GroupTable.own_pages`): `parent`
    is that list (None once this list was copied in turn) and its first `shared` pages are still the same,
    so a holder of the parent (the runner's kept page tables) rewrites only the pages from `shared` on."""

    __slots__ = ("parent", "shared")


@dataclass
class GroupTable:
    """One request's pages in one group: `pages[j]` holds tokens [j*T, (j+1)*T) (NULL_PAGE if not held).

    For a checkpoint group `pages` is `[running_state_page]`.
    """

    pages: list[int] = field(default_factory=list)
    num_cached_pages: int = 0  # leading pages already offered to the cache
    last_checkpoint: int = 0  # checkpoint groups: tokens at the latest saved state
    save_points: list[int] = field(default_factory=list)  # checkpoint groups: tokens saved in pages[1:]
    handed_out: bool = False  # `pages` went out through `KVCacheManager.block_ids`: never edit it in place

    num_dropped: int = 0  # window groups: leading pages already replaced by NULL_PAGE

    def own_pages(self, edit_from: int = 0) -> list[int]:
        """`pages`, ready to edit in place from index `edit_from` on: copied first if it was handed out
        (the holder's list stays as it was), so a step's tables are not copied while they do not change.
        The copy records which pages it still shares with the list handed out (`PageList`)."""
        if self.handed_out:
            parent = self.pages
            if isinstance(parent, PageList):
                parent.parent = None  # one link back is all a holder reads: no chain of old lists
            copy = PageList(parent)
            copy.parent, copy.shared = parent, len(parent)
            self.pages = copy
            self.handed_out = False
        if isinstance(self.pages, PageList):
            self.pages.shared = min(self.pages.shared, edit_from)
        return self.pages


class GroupManager:
    """Shared behaviour; subclasses implement `find_hit` and the table shape for one hit rule."""

    def __init__(self, group: KVGroup, pool: BlockPool, hash_block_size: int):
        self.group = group
        self.group_id = group.group_id
        self.pool = pool
        self.tokens_per_page = group.tokens_per_page
        self.hashes_per_page = group.tokens_per_page // hash_block_size
        self.token_granular = group.spec.token_granular
        self.index = pool.cached[group.group_id]

    def page_keys(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """The hash naming each full page: the chained hash of the page's last base block."""
        step = self.hashes_per_page
        return hashes if step == 1 else hashes[step - 1::step]

    def find_hit(self, keys: list[BlockHash], limit: int, cap: int) -> int:
        """The longest hit <= `limit` this group can serve; `cap` (prompt length - 1) may be unaligned."""
        raise NotImplementedError

    def reused_pages(self, keys: list[BlockHash], hit: int) -> tuple[list[int], int]:
        """(cached pages the hit takes, index of the first of them in the block table)."""
        raise NotImplementedError

    def page_array(self, pages: list[int]) -> np.ndarray:
        """`pages` (reused pages this group returned) as an int64 array."""
        return np.asarray(pages, dtype=np.int64)

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def num_new_pages(self, table_start: int, num_reused: int, num_tokens: int) -> int:
        return self.num_pages_for(num_tokens) - table_start - num_reused

    def build_table(self, table_start: int, reused: list[int], new_pages: list[int]) -> GroupTable:
        return GroupTable([NULL_PAGE] * table_start + reused + new_pages, num_cached_pages=table_start + len(reused))

    def grow(self, table: GroupTable, num_tokens: int) -> int:
        """Pages to add so that the table covers `num_tokens` tokens."""
        return max(0, self.num_pages_for(num_tokens) - len(table.pages))

    def cache_full_pages(self, table: GroupTable, keys: list[BlockHash], num_computed: int,
                         tokens_of_page) -> None:
        """Offer pages whose tokens are all written to the cache (first come is kept on duplicates)."""
        limit = min(num_computed // self.tokens_per_page, len(keys), len(table.pages))
        pool, group_id = self.pool, self.group_id
        start = table.num_cached_pages
        if limit - start > 1 and not pool.enable_events:
            pages = table.pages[start:limit]
            if NULL_PAGE not in pages:  # a full run of real pages: cached in bulk
                parents = ([None] + keys[:limit - 1]) if start == 0 else keys[start - 1:limit - 1]
                pool.cache_pages(pages, group_id, keys[start:limit], parents)
                table.num_cached_pages = max(table.num_cached_pages, limit)
                return
        for j in range(table.num_cached_pages, limit):
            page = table.pages[j]
            if page != NULL_PAGE:
                tokens = tokens_of_page(j) if pool.enable_events else None
                pool.cache_page(page, group_id, keys[j], keys[j - 1] if j else None, tokens)
        table.num_cached_pages = max(table.num_cached_pages, limit)

    def pages_out_of_window(self, table: GroupTable, num_computed: int) -> list[int]:
        return []

    def release_order(self, table: GroupTable) -> list[int]:
        """The request's pages, tail first: the order in which they should be evicted."""
        return table.pages[::-1]


class PrefixGroup(GroupManager):
    """Full attention, MLA latent, compressed latent, indexer keys: every earlier token is needed."""

    _last_run: tuple | None = None
    _handed_out: tuple[list[int], np.ndarray] | None = None  # the last run returned, and its pages' array

    def __init__(self, group: KVGroup, pool: BlockPool, hash_block_size: int):
        super().__init__(group, pool, hash_block_size)
        # An earlier turn's run of the same prefix answers most of the next turn's without index reads.
        self.known_runs = KnownRuns(pool, max_pages=2 * pool.num_pages)

    def cached_run(self, keys: list[BlockHash], max_pages: int) -> list[int]:
        """Pages of the leading cached keys: a still-mapped run remembered from an earlier call, then
        dict lookups in C via map past it. The last run is also kept for this same `keys` list: one
        that stopped at a missing key answers any longer request too."""
        last = self._last_run
        if last is not None and last[0] is keys and last[1] == self.pool.version:
            run, array = last[2], last[4]
            if len(run) >= max_pages:
                return self._hand_out(run[:max_pages], array[:max_pages])
            if len(run) < last[3] or last[3] == len(keys):  # it stopped at a miss, or at the last key
                return self._hand_out(run, array)
        mapped = min(max_pages, len(keys))
        run, array = self.known_runs.known_prefix(keys, mapped)
        if len(run) < mapped:
            tail = leading_cached(self.index, keys, len(run), mapped)
            if tail:
                run = run + tail
                array = np.concatenate([array, np.asarray(tail, dtype=np.int32)])
                self.known_runs.remember(keys, run, array)
        self._last_run = (keys, self.pool.version, run, mapped, array)
        return self._hand_out(run, array)

    def _hand_out(self, run: list[int], array: np.ndarray) -> list[int]:
        self._handed_out = (run, array)
        return run

    def page_array(self, pages: list[int]) -> np.ndarray:
        """The run `cached_run` returned last as the array its known run keeps (no conversion page by
        page); any other list is converted."""
        handed_out = self._handed_out
        if handed_out is not None and handed_out[0] is pages:
            return handed_out[1].astype(np.int64)
        return super().page_array(pages)

    def find_hit(self, keys: list[BlockHash], limit: int, cap: int) -> int:
        size = self.tokens_per_page
        extent = len(self.cached_run(keys, -(-limit // size))) * size
        if limit <= extent and (limit % size == 0 or (limit == cap and self.token_granular)):
            return limit
        return min(extent, limit // size * size)

    def reused_pages(self, keys: list[BlockHash], hit: int) -> tuple[list[int], int]:
        return self.cached_run(keys, -(-hit // self.tokens_per_page)), 0


class WindowGroup(GroupManager):
    """Sliding window or rolling state: only the pages inside the last `window` tokens are kept."""

    def __init__(self, group: KVGroup, pool: BlockPool, hash_block_size: int):
        super().__init__(group, pool, hash_block_size)
        self.window = group.spec.window

    def first_needed_page(self, position: int) -> int:
        """The first page a query at `position` reads (it sees the `window - 1` tokens before it)."""
        return max(0, position - self.window + 1) // self.tokens_per_page

    def find_hit(self, keys: list[BlockHash], limit: int, cap: int) -> int:
        size, index = self.tokens_per_page, self.index
        hit = limit
        while hit > 0:
            if hit % size and not (hit == cap and self.token_granular):
                hit = hit // size * size
                continue
            last = -(-hit // size) - 1
            missing = next((j for j in range(last, self.first_needed_page(hit) - 1, -1)
                            if j >= len(keys) or keys[j] not in index), None)
            if missing is None:
                return hit
            hit = missing * size
        return 0

    def reused_pages(self, keys: list[BlockHash], hit: int) -> tuple[list[int], int]:
        if hit == 0:
            return [], 0
        first = self.first_needed_page(hit)
        return [self.index[keys[j]] for j in range(first, -(-hit // self.tokens_per_page))], first

    def pages_out_of_window(self, table: GroupTable, num_computed: int) -> list[int]:
        """Replace pages that no future query reads by NULL_PAGE; return them oldest first."""
        first_needed = min(self.first_needed_page(num_computed), len(table.pages))
        dropped = []
        for j in range(table.num_dropped, first_needed):  # the pages before num_dropped are NULL already
            if table.pages[j] != NULL_PAGE:
                dropped.append(table.pages[j])
                table.own_pages(j)[j] = NULL_PAGE
        table.num_dropped = max(table.num_dropped, first_needed)
        return dropped

    def release_order(self, table: GroupTable) -> list[int]:
        return [page for page in reversed(table.pages) if page != NULL_PAGE]


class CheckpointGroup(GroupManager):
    """A fixed-size recurrent state: one running page per request; checkpoints are page copies.

    A hit at `h` tokens copies the checkpoint saved at `h` into the request's running page; saving
    a checkpoint copies the running page into a fresh page that becomes cached (and free).
    """

    def find_hit(self, keys: list[BlockHash], limit: int, cap: int) -> int:
        size = self.tokens_per_page
        hit = limit // size * size
        while hit > 0 and (hit // size > len(keys) or keys[hit // size - 1] not in self.index):
            hit -= size
        return hit

    def reused_pages(self, keys: list[BlockHash], hit: int) -> tuple[list[int], int]:
        # The checkpoint page is read once (a copy), not kept in the table; see the manager.
        return ([self.index[keys[hit // self.tokens_per_page - 1]]] if hit else []), 0

    def num_new_pages(self, table_start: int, num_reused: int, num_tokens: int) -> int:
        return 1

    def build_table(self, table_start: int, reused: list[int], new_pages: list[int]) -> GroupTable:
        return GroupTable(list(new_pages))

    def grow(self, table: GroupTable, num_tokens: int) -> int:
        return 0

    def checkpoint_key(self, keys: list[BlockHash], num_computed: int) -> BlockHash | None:
        """The key of a checkpoint to save after `num_computed` tokens, or None if none is due."""
        size = self.tokens_per_page
        if num_computed == 0 or num_computed % size or num_computed // size > len(keys):
            return None
        key = keys[num_computed // size - 1]
        return None if key in self.index else key


def make_group_manager(group: KVGroup, pool: BlockPool, hash_block_size: int) -> GroupManager:
    rule = group.spec.hit_rule
    cls = {"prefix": PrefixGroup, "window": WindowGroup, "checkpoint": CheckpointGroup}[rule]
    return cls(group, pool, hash_block_size)


def leading_cached(index: dict, keys: list[BlockHash], start: int, stop: int) -> list[int]:
    """The pages of `keys[start:stop]` up to the first key `index` lacks. Probed in chunks that double
    (dict lookups in C via map), so a run that ends soon after `start`, as under cache pressure, costs a
    few probes instead of one per key up to `stop`."""
    found: list[int] = []
    chunk = 8
    while start < stop:
        end = min(stop, start + chunk)
        part = list(map(index.get, keys[start:end]))
        if None in part:
            return found + part[:part.index(None)]
        found += part
        start, chunk = end, 2 * chunk
    return found
