"""What each KV page group holds in bytes: used (pages of running requests and cached pages) and
reserved (the memory the layout sets aside for it), for `Engine.stats()` and `/metrics`.

A "pool" layout reserves whole slabs per group; a "shared" layout reserves, for every page id in use,
a page of every kind (agentjax/kv/layout.py). Host only: never imports jax.
"""
from __future__ import annotations

import numpy as np

from agentjax.kv.block_pool import NULL_PAGE


def group_memory(manager) -> list[dict]:
    """Per page group of `manager` (built `from_layout`): name, tokens per page, page bytes, pages held
    by requests, cached free pages, used and reserved bytes, and the prompt tokens the group alone
    could have served from its cache (`hit_tokens`). [] without a layout."""
    layout = manager.layout
    if layout is None:
        return []
    pool = manager.pool
    names = layout.group_names()
    if layout.mode == "pool":
        owned, held, cached = pool.group_usage()
        reserved = owned * layout.slab_bytes
    else:
        held = np.zeros(len(layout.groups), dtype=np.int64)
        for request in manager.running_requests():
            for group, table in enumerate(request.tables):
                held[group] += len(table.pages) - table.pages.count(NULL_PAGE)
        free_cached = pool.page_group[(pool.ref_counts == 0) & (pool.page_group >= 0)]
        cached = np.bincount(free_cached, minlength=len(layout.groups))
        reserved = (held + cached) * layout.slab_bytes  # every page id in use spans every kind's page
    rows = []
    for g, group in enumerate(layout.groups):
        page = layout.page_bytes(g)
        rows.append({"group": names[g], "tokens_per_page": group.tokens_per_page, "page_bytes": page,
                     "held_pages": int(held[g]), "cached_pages": int(cached[g]),
                     "used_bytes": int((held[g] + cached[g]) * page), "reserved_bytes": int(reserved[g]),
                     "hit_tokens": int(manager.group_hits[g])})
    return rows
