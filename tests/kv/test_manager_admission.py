"""Tests of transactional admission in agentjax/kv/manager.py: allocate, a failed append, then free
rolls the pool, the eviction order, the cached set, the events and the stats back exactly."""
import numpy as np

from agentjax.kv import BlockRemoved, BlockStored, KVCacheManager


def _snapshot(m: KVCacheManager):
    pool = m.pool
    stats = m.stats()
    return (pool.eviction_order.live_pages_in_order().tolist(), [dict(index) for index in pool.cached],
            pool.ref_counts.tolist(), pool.num_free, pool.num_cached,
            {k: stats[k] for k in ("queries", "hits", "evictions", "free_blocks", "cached_blocks")})


def _finished(m, req_id, tokens):
    assert m.allocate(req_id, tokens)
    assert m.append(req_id, [9])  # commits
    m.free(req_id)


def test_free_after_a_failed_append_restores_order_cache_and_stats_exactly():
    m = KVCacheManager.full_attention(num_blocks=13, block_size=4, enable_kv_events=True)  # 12 pages
    _finished(m, "a", list(range(100, 116)))  # 5 pages, 4 cached
    _finished(m, "b", list(range(200, 216)))
    m.take_events()
    before = _snapshot(m)
    prompt = list(range(100, 112)) + list(range(300, 308))  # hits a's first 3 pages, needs 2 new
    assert m.allocate("c", prompt) and m.num_cached_tokens("c") == 12
    assert m.append("c", [7] * 40) is False
    m.free("c")
    assert _snapshot(m) == before
    events = m.take_events()
    stored = [e.block_hash for e in events if isinstance(e, BlockStored)]
    removed = [e.block_hash for e in events if isinstance(e, BlockRemoved)]
    assert sorted(stored) == sorted(removed)  # net zero: what is hittable did not change
    assert m.stats()["rollbacks"] == 1
    m.check_invariants()


def test_a_committed_request_is_freed_normally_and_keeps_its_pages_cached():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4)
    prompt = list(range(16))
    assert m.allocate("a", prompt) and m.append("a", [1])
    m.free("a")
    assert m.lookup(prompt + [5]) == 16 and m.stats()["rollbacks"] == 0


def test_an_uncommitted_abort_leaves_nothing_hittable_in_deferred_mode_and_after_cache_blocks_zero():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4, cache_on_allocate=False)
    before = _snapshot(m)
    assert m.allocate("a", list(range(16)))
    m.cache_blocks("a", 0)  # zero computed tokens: still uncommitted
    m.free("a")
    assert _snapshot(m) == before


def test_block_ids_commits_because_the_device_may_write_the_pages():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4)
    assert m.allocate("a", list(range(16)))
    m.block_ids("a")
    m.free("a")
    assert m.stats()["rollbacks"] == 0 and m.lookup(list(range(17))) == 16


def test_rollback_puts_pages_back_even_after_other_requests_moved_the_queue_head():
    m = KVCacheManager.full_attention(num_blocks=40, block_size=4)
    for i in range(6):
        _finished(m, f"f{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 12)))
    before = _snapshot(m)
    assert m.allocate("x", list(range(1000, 1008)) + list(range(50, 70)))  # reuses f0's head pages
    assert m.append("x", [7] * 200) is False
    m.free("x")
    assert _snapshot(m) == before
    m.check_invariants()


def test_random_admit_fail_free_cycles_match_a_manager_that_never_saw_them():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, 64).tolist() for _ in range(4)]
    m = KVCacheManager.full_attention(num_blocks=30, block_size=4)
    twin = KVCacheManager.full_attention(num_blocks=30, block_size=4)
    for step in range(300):
        prompt = docs[rng.integers(4)][:int(rng.integers(1, 64))] + rng.integers(1, 50, int(rng.integers(0, 8))).tolist()
        output = int(rng.integers(1, 40))
        if m.allocate(f"r{step}", prompt) and not m.append(f"r{step}", [7] * output):
            m.free(f"r{step}")  # the harness's failed admission: must leave no trace
            continue
        if f"r{step}" in {r.req_id for r in m.running_requests()}:
            m.free(f"r{step}")
            assert twin.allocate(f"r{step}", prompt) and twin.append(f"r{step}", [7] * output)
            twin.free(f"r{step}")
        assert _snapshot(m)[:5] == _snapshot(twin)[:5]
    assert m.stats()["hits"] == twin.stats()["hits"] and m.stats()["queries"] == twin.stats()["queries"]
