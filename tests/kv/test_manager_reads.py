"""The KV manager's public face for the engine, the server and the offload connector
(agentjax/kv/manager_reads.py and the reads of agentjax/kv/manager_lookup.py): capacity reads, load
holds, and the lookups the connector makes instead of reading the manager's private members."""
import numpy as np

from agentjax.kv import BlockRemoved, BlockStored, KVCacheManager, PolicyEvictionOrder
from agentjax.kv.policies import make_policy

PROMPT = list(range(100, 140))  # 40 tokens: 2 whole pages of 16 and a partial one


def test_capacity_reads_and_cached_pages_by_group():
    m = KVCacheManager.full_attention(num_blocks=32, block_size=16)
    assert m.num_pages == m.pool.num_pages == 32 and m.units_are_pages
    assert m.allocate("a", PROMPT)
    assert m.cached_blocks_by_group() == [(0, "full_attention", 2)]
    pages = np.asarray(m.block_ids("a")[0], dtype=np.int64)
    assert m.holds_block(pages).tolist() == [True, True, False]
    assert m.cached_index(0) is m.pool.cached[0] and set(m.cached_index(0).values()) == set(pages[:2].tolist())


def test_running_requests_and_pages_being_written_read_what_the_manager_holds():
    m = KVCacheManager.full_attention(num_blocks=32, block_size=16)
    assert m.running("a") is None and m.running_requests() == []
    assert m.allocate("a", PROMPT) and m.allocate("b", PROMPT[:20])
    assert [r.req_id for r in m.running_requests()] == ["a", "b"]
    assert m.running("a").hashes == m.block_hashes("a") and len(m.running("a").hashes) == 2
    assert m.pages_being_written() == set()  # a full-attention manager copies no states


def test_evict_free_pages_empties_the_device_cache_and_leaves_held_pages_alone():
    m = KVCacheManager.full_attention(num_blocks=32, block_size=16)
    m.enable_events()
    assert m.allocate("a", PROMPT) and m.allocate("b", list(range(500, 540)))
    m.block_ids("a")  # committed: its free keeps the cached pages
    m.free("a")
    assert [type(event) for event in m.take_events()] == [BlockStored] * 4  # both requests' whole pages
    assert m.evict_free_pages() == 2  # a's two cached pages; b still holds its own
    assert [type(event) for event in m.take_events()] == [BlockRemoved] * 2
    assert m.lookup(PROMPT) == 0 and m.lookup(list(range(500, 540))) == 32


def test_a_load_holds_pages_until_released_and_its_pages_become_cached_hits():
    m = KVCacheManager.full_attention(num_blocks=32, block_size=16)
    assert m.allocate("a", PROMPT)
    hashes = m.block_hashes("a")
    m.block_ids("a")
    m.free("a")
    resident = np.asarray([m.cached_index(0)[hashes[0]]], dtype=np.int64)
    m.pool.evict(m.cached_index(0)[hashes[1]])  # the second page went to a tier
    free_before = m.num_free_blocks
    assert m.load_units([0], resident) == 2  # a new page, and the free resident page it holds
    m.hold_pages(resident)
    staged = m.take_load_pages([0])
    assert m.num_free_blocks == free_before - 2
    assert m.cache_loaded_page(int(staged[0]), 0, hashes[1], hashes[0]) is True
    m.release_pages(np.concatenate([staged, resident]))
    assert m.num_free_blocks == free_before and m.lookup(PROMPT) == 32
    m.check_invariants()


def test_pins_protect_free_units_and_the_kv_policy_is_the_orders():
    plain = KVCacheManager.full_attention(num_blocks=32, block_size=16)
    assert plain.kv_policy is None
    policy = make_policy("hints")
    m = KVCacheManager.full_attention(num_blocks=32, block_size=16, eviction_order=PolicyEvictionOrder(policy))
    assert m.kv_policy is policy
    assert m.allocate("a", PROMPT)
    m.free("a", pin_session="s")  # pinning commits the admission
    assert m.pinned_free_units() == 2 and m.kv_policy.num_pinned() == 2
    m.unpin("s")
    assert m.pinned_free_units() == 0
