"""Tests of agentjax/kv/usage.py: each page group's used and reserved bytes, on a pool and on shared ids."""
from __future__ import annotations

from agentjax.kv import KVCacheManager
from agentjax.kv.layout_build import build_layout
from agentjax.kv.usage import group_memory
from agentjax.models import preset_config


def _manager(mode: str) -> KVCacheManager:
    layout = build_layout(preset_config("tiny-sliding"), 16, memory_bytes=1 << 20, mode=mode)
    manager = KVCacheManager.from_layout(layout)
    tokens = [(5 * i) % 300 + 1 for i in range(200)]
    assert manager.allocate("long", tokens, num_reserved_tokens=64)  # the window group: the first chunk
    manager.cache_blocks("long", 64)
    return manager


def test_a_pool_reserves_whole_slabs_per_group_and_counts_held_and_cached_pages():
    manager = _manager("pool")
    window, full = group_memory(manager)
    assert (window["group"], full["group"]) == ("kv.0", "kv.1")
    assert full["held_pages"] == 13 and window["held_pages"] == 1  # 200 tokens; the window's pages at 64
    slab = manager.layout.slab_bytes
    for row in (window, full):
        assert row["used_bytes"] == (row["held_pages"] + row["cached_pages"]) * row["page_bytes"]
        assert row["reserved_bytes"] % slab == 0 and row["used_bytes"] <= row["reserved_bytes"]
    assert full["reserved_bytes"] < full["used_bytes"] + slab  # whole slabs, no more


def test_shared_ids_reserve_every_kinds_page_behind_each_page_in_use():
    manager = _manager("shared")
    rows = group_memory(manager)
    page_id_bytes = manager.layout.slab_bytes
    for row in rows:
        assert row["reserved_bytes"] == (row["held_pages"] + row["cached_pages"]) * page_id_bytes
        assert row["used_bytes"] < row["reserved_bytes"]
