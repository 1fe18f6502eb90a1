"""Tests of agentjax/kv/block_pool.py: the null page, reference counts, LRU eviction, events."""
import numpy as np
import pytest

from agentjax.errors import InvalidRequestError, OutOfPagesError
from agentjax.kv.block_pool import NULL_PAGE, BlockPool
from agentjax.kv.eviction import LRUEvictionOrder
from agentjax.kv.events import BlockRemoved, BlockStored


def _pages(*ids):
    return np.asarray(ids, dtype=np.int64)


def test_the_null_page_is_never_handed_out():
    pool = BlockPool(5)
    pages = pool.allocate(4).tolist()
    assert NULL_PAGE not in pages and sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPagesError, match="need 1 free KV pages, only 0 free"):
        pool.allocate(1)
    pool.check_invariants()


def test_freed_pages_are_reused_least_recently_freed_first_in_the_given_order():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(3)
    pool.release(a[::-1])  # tail first
    pool.release(b[::-1])
    assert pool.eviction_order.live_pages_in_order().tolist() == [7] + a[::-1].tolist() + b[::-1].tolist()
    assert pool.allocate(4).tolist() == [7] + a[::-1].tolist()


def test_a_hit_on_a_free_cached_page_keeps_it_from_eviction():
    pool = BlockPool(4)
    pages = pool.allocate(3)
    for i, page in enumerate(pages.tolist()):
        pool.cache_page(page, 0, bytes([i]) * 32, None)
    pool.release(pages)
    assert pool.num_free == 3 and pool.num_cached == 3
    pool.touch(_pages(pages[0]))
    assert pool.num_free == 2
    taken = pool.allocate(2).tolist()
    assert pages[0] not in taken
    assert pool.cached_page(0, bytes([0]) * 32) == pages[0]
    assert pool.cached_page(0, bytes([1]) * 32) is None and pool.evictions == 2
    pool.check_invariants()


def test_cached_pages_are_keyed_by_group_and_hash_and_events_are_recorded():
    pool = BlockPool(4, num_groups=2, enable_events=True)
    p = pool.allocate(2).tolist()
    assert pool.cache_page(p[0], 0, b"h" * 32, None, (1, 2))
    assert not pool.cache_page(p[1], 0, b"h" * 32, None), "a duplicate block is not cached twice"
    assert pool.cache_page(p[1], 1, b"h" * 32, None)
    assert pool.cached_page(1, b"h" * 32) == p[1]
    pool.release(_pages(*p))
    pool.allocate(3)
    events = pool.take_events()
    assert events[:2] == [BlockStored(b"h" * 32, None, (1, 2), 0), BlockStored(b"h" * 32, None, (), 1)]
    assert sorted((e.group for e in events[2:])) == [0, 1] and all(isinstance(e, BlockRemoved) for e in events[2:])
    assert pool.take_events() == []


def test_releasing_a_page_more_often_than_taken_names_the_page():
    pool = BlockPool(3)
    page = pool.allocate(1)
    pool.release(page)
    with pytest.raises(InvalidRequestError, match=str(int(page[0]))):
        pool.release(page)


def test_lru_queue_compacts_and_stays_exact_over_many_cycles():
    pool = BlockPool(6, eviction_order=LRUEvictionOrder())
    rng = np.random.default_rng(3)
    for _ in range(2000):
        held = pool.allocate(int(rng.integers(1, 4)))
        if rng.random() < 0.5:
            pool.touch(held[:1])
            pool.release(held[:1])
        pool.release(held[::-1])
        pool.check_invariants()
    assert sorted(pool.eviction_order.live_pages_in_order().tolist()) == [1, 2, 3, 4, 5]


def test_pool_needs_a_page_beside_the_null_page():
    with pytest.raises(InvalidRequestError, match="got 1"):
        BlockPool(1)


def test_taking_one_page_takes_the_first_live_page_past_dead_queue_entries():
    pool = BlockPool(40, eviction_order=LRUEvictionOrder())
    order = pool.eviction_order
    rng = np.random.default_rng(11)
    for _ in range(500):
        held = pool.allocate(int(rng.integers(1, 12)))
        hit = rng.choice(np.flatnonzero(pool.ref_counts == 0), size=int(rng.integers(0, 12)), replace=False)
        pool.touch(hit)  # hits kill queue entries in front of the victim (more than the 8 read one by one)
        expected = order.live_pages_in_order()[0]
        one = pool.allocate(1)
        assert one.tolist() == [expected] and order.victim_positions().shape == (1,)
        pool.release(np.concatenate([one, held, hit]))
        pool.check_invariants()
