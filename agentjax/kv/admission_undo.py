"""Rolling back an uncommitted admission of the KV manager (`KVCacheManager.free` of an aborted request).

From `allocate` until a request is committed, the manager keeps an `AdmissionUndo` (agentjax/kv/requests.py).
A request is committed by its first successful `append`, a `cache_blocks` call with
`num_computed_tokens > 0`, `block_ids` (the device may write its pages from then on),
`take_pending_copies` while it has a checkpoint copy pending, or `free(..., pin_session=...)`; and,
in `cache_on_allocate` mode only, by an allocation that already releases pages (a sliding window's
or a state checkpoint's). `free` of an uncommitted request rolls the admission back: reused cached
pages return to the eviction position they held (not the MRU end), pages taken from the free set
return to their former positions with their former cached hashes (a `BlockRemoved` for what the
admission cached, a `BlockStored` for what it evicted, so the event stream always matches what is
hittable), and `queries`, `hits` and `evictions` drop what the admission added. With no other request
in between, the pool, the eviction order and the stats equal those before `allocate`. Pages another
request hit meanwhile stay with it, and a hash cached elsewhere meanwhile is not restored.
Host only: never imports jax; it only ever undoes what the admission recorded.
"""
from __future__ import annotations

import numpy as np

from agentjax.kv.requests import AdmissionUndo, RequestKV

__all__ = ["roll_back"]


def roll_back(manager, request: RequestKV, undo: AdmissionUndo) -> None:
    """Undo an uncommitted admission: the pool, the eviction order and the counters return to
    where they were before `allocate` (other requests' changes since then stay). `manager` is the
    `KVCacheManager` that admitted `request`; it no longer lists the request."""
    pool = manager.pool
    # Still pending (take_pending_copies would have committed the request). Its own entries are the
    # latest equal ones: an earlier save may read or write the same pages.
    for copy in reversed(undo.copies):
        _remove_last(manager._pending_copies, copy)
    for source in reversed(undo.copy_sources):
        _remove_last(manager._pending_copy_sources, source)
    manager._uncommitted_with_copies.discard(request.req_id)
    order = manager.release_order(request)
    pool.release(np.asarray(order + undo.copy_sources, dtype=np.int64))
    if undo.new_pages:
        new_pages = np.concatenate(undo.new_pages) if len(undo.new_pages) > 1 else undo.new_pages[0]
        new_positions = np.concatenate(undo.new_positions) if len(undo.new_positions) > 1 else undo.new_positions[0]
        free_now = new_pages[pool.ref_counts[new_pages] == 0]  # not hit by another request meanwhile
        for page in free_now.tolist():
            pool.uncache(page)
        if undo.evicted:
            free_set = set(free_now.tolist())
            for pages, hashes, groups, parents, tokens in undo.evicted:
                for i, page in enumerate(pages):
                    if page in free_set:
                        pool.restore_cached(page, groups[i], hashes[i], parents[i], tokens[i] if tokens else ())
        pool.restore_free(new_pages, new_positions)
    if undo.slab_moves:
        pool.undo_moves(undo.slab_moves)
    pool.restore_free(undo.reused_pages, undo.reused_positions)
    manager.queries -= undo.num_tokens
    manager.hits -= undo.num_hit
    if undo.group_hits:
        manager.group_hits = [total - mine for total, mine in zip(manager.group_hits, undo.group_hits)]
    manager.turn_end_hits -= undo.turn_end_hit
    manager.rollbacks += 1


def _remove_last(items: list, value) -> None:
    """Delete the last element equal to `value`."""
    del items[len(items) - 1 - items[::-1].index(value)]
