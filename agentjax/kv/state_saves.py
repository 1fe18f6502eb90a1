"""Recurrent-state checkpoints inside a prefill chunk: which pages the device saves them in, and
caching them once it has.

A recurrent-state group keeps one running page per request; a chunk that crosses multiples of the
group's interval saves the state at each of them into pages listed after the running page (column 1
on, `RaggedBatch.build` reads the same order), and the manager caches them once the step ran. A
checkpoint already cached, or one no page is free for, gets the null page: the device saves nothing
there. Host only: never imports jax, never decides which chunks run.
"""
from __future__ import annotations

import logging

import numpy as np

from agentjax.kv.block_pool import NULL_PAGE
from agentjax.kv.groups import CheckpointGroup, GroupTable
from agentjax.kv.hashing import BlockHash

logger = logging.getLogger(__name__)


def max_state_pages(chunk_tokens: int, interval: int, draft_states: int = 0) -> int:
    """The most pages one request holds in a recurrent-state group at once: its running page, one per
    checkpoint strictly inside a chunk of `chunk_tokens` tokens, or one per draft token's state."""
    return 1 + max(draft_states, -(-max(chunk_tokens - 1, 0) // interval))


def interior_boundaries(start: int, end: int, interval: int) -> range:
    """Multiples of `interval` strictly inside the chunk of tokens [start, end)."""
    return range((start // interval + 1) * interval, end, interval)


def reserve_saves(group: CheckpointGroup, table: GroupTable, keys: list[BlockHash], start: int, end: int,
                  pool) -> int:
    """Put save pages for the checkpoints strictly inside [start, end) after the running page of `table`
    (nothing if the table already holds more than its running page: draft states). Returns how many
    pages it took."""
    if len(table.pages) != 1 or table.save_points:
        return 0
    size = group.tokens_per_page
    points = [b for b in interior_boundaries(start, end, size) if b // size <= len(keys)]
    columns: list[int] = []
    for boundary in points:
        if keys[boundary // size - 1] in group.index or not pool_has_room(pool, group.group_id):
            columns.append(NULL_PAGE)
        else:
            columns.append(int(pool.allocate(1, group=group.group_id)[0]))
    while columns and columns[-1] == NULL_PAGE:
        columns.pop()
    if not any(columns):
        return 0
    table.own_pages(len(table.pages)).extend(columns)
    table.save_points = points[:len(columns)]
    return sum(1 for page in columns if page != NULL_PAGE)


def cache_saves(group: CheckpointGroup, table: GroupTable, keys: list[BlockHash], num_computed: int, pool) -> None:
    """The device ran the chunk: cache the saved states it reached (and free their pages, which stay
    hittable), give back the others; the table is its running page again."""
    if not table.save_points:
        return
    size = group.tokens_per_page
    done: list[int] = []
    for boundary, page in zip(table.save_points, table.pages[1:]):
        if page == NULL_PAGE:
            continue
        if boundary <= num_computed:
            index = boundary // size - 1
            pool.cache_page(page, group.group_id, keys[index], keys[index - 1] if index else None)
            table.last_checkpoint = max(table.last_checkpoint, boundary)
        done.append(page)
    del table.own_pages(1)[1:]
    table.save_points = []
    if done:
        pool.release(np.asarray(done, dtype=np.int64))


def pool_has_room(pool, group: int) -> bool:
    """One free page for `group` (a whole slab's worth counted by a slab pool)."""
    return bool(pool.num_free) if pool.num_groups_share_ids else pool.can_take({group: 1})
