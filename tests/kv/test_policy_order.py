"""PolicyEvictionOrder (agentjax/kv/policy_order.py) driving a real KVCacheManager with a policy:
empty pages first, the policy's order, pins, undo of an uncommitted admission, a cache cap."""
import numpy as np

from agentjax.kv import KVCacheManager
from agentjax.kv.policies import LRUPolicy
from agentjax.kv.policy_order import PolicyEvictionOrder


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def _manager(num_blocks=13, policy=None):
    clock = Clock()
    policy = policy or LRUPolicy(clock)
    order = PolicyEvictionOrder(policy)
    manager = KVCacheManager.full_attention(num_blocks=num_blocks, block_size=4, eviction_order=order, clock=clock)
    return manager, policy, order, clock


def _turn(manager, req_id, tokens):
    """A finished turn: its full pages cached, then freed; returns its pages."""
    assert manager.allocate(req_id, tokens)
    pages = manager.block_ids(req_id)[0]
    manager.free(req_id)
    return pages


def _cached(manager, tokens):
    return manager.lookup(list(tokens) + [1])


def test_lru_policy_through_the_manager_evicts_the_oldest_turn_tail_first():
    manager, _, _, _ = _manager(num_blocks=13)  # 12 usable pages
    first = list(range(100, 116))  # 4 full pages
    second = list(range(200, 216))
    _turn(manager, "a", first + [7])  # 5 pages: 4 cached and a partial (uncached) one
    _turn(manager, "b", second + [7])
    assert _cached(manager, first) == 16 and _cached(manager, second) == 16
    # 4 empty pages (2 never used, 2 partial) are taken first, then the oldest turn's pages, tail
    # first: "a" keeps its first two pages.
    _turn(manager, "c", list(range(300, 320)) + [7])  # 6 pages
    assert _cached(manager, first) == 8
    assert _cached(manager, second) == 16
    manager.check_invariants()

def test_empty_pages_go_before_any_cached_page():
    manager, _, _, _ = _manager(num_blocks=13)  # 12 usable pages
    first = list(range(100, 132))
    _turn(manager, "a", first + [5])  # 9 pages: 8 cached, the partial one empty once freed
    _turn(manager, "b", list(range(500, 504)) + [5])  # 2 pages: one cached, a partial freed after "a"
    # 4 pages: the 3 empty ones (one freed after every page of "a"), then "a"'s tail. Plain LRU by
    # free time would take the two never-used pages and then two of "a"'s pages.
    _turn(manager, "c", list(range(900, 912)) + [5])
    assert _cached(manager, first) == 28
    assert _cached(manager, range(500, 504)) == 4

def test_pins_keep_pages_until_every_unpinned_page_is_gone_and_expire_on_the_clock():
    manager, policy, order, clock = _manager(num_blocks=13)
    session = list(range(100, 116))
    _turn(manager, "a", session + [1])
    assert manager.allocate("s", session + [1])
    assert manager.pin_request("s-pin", "s", ttl_s=5.0) == 4
    manager.free("s")
    assert manager.stats()["pinned_blocks"] == 4
    _turn(manager, "b", list(range(200, 228)) + [1])  # 8 pages: every unpinned page goes first
    assert _cached(manager, session) == 16
    clock.now += 6.0  # the pin expired: the session's pages are plain LRU pages again
    _turn(manager, "c", list(range(300, 312)) + [1])
    assert _cached(manager, session) < 16
    assert order.num_pinned() == (0, 0)

def test_a_pinned_page_evicted_under_pressure_leaves_its_pin_and_is_counted():
    manager, policy, order, _ = _manager(num_blocks=6)  # 5 usable pages
    session = list(range(100, 116))
    assert manager.allocate("s", session + [1])
    manager.block_ids("s")  # committed: the device writes its pages
    manager.pin_request("k", "s")
    manager.free("s")
    _turn(manager, "b", list(range(200, 212)) + [1])  # 4 pages: 1 empty, then 3 pinned ones
    assert order.pinned_evictions == 3
    assert policy.unpin("k") == 1  # only the page that kept its content was still pinned

def test_an_uncommitted_admission_rolls_back_the_policy_state():
    manager, policy, _, _ = _manager(num_blocks=13)
    _turn(manager, "a", list(range(100, 116)) + [1])
    _turn(manager, "b", list(range(200, 216)) + [1])
    before = policy.page_state(np.arange(1, 13))
    free_order = policy.evict_order(np.flatnonzero(manager.pool.ref_counts == 0))
    assert manager.allocate("x", list(range(100, 108)) + list(range(400, 420)))  # hits 2 pages, evicts others
    manager.free("x")  # never committed: rolled back
    assert np.array_equal(policy.page_state(np.arange(1, 13)), before)
    assert np.array_equal(policy.evict_order(np.flatnonzero(manager.pool.ref_counts == 0)), free_order)
    manager.check_invariants()

def test_evict_cached_beyond_caps_the_cache_in_policy_order():
    manager, _, order, _ = _manager(num_blocks=13)
    _turn(manager, "a", list(range(100, 116)) + [1])
    _turn(manager, "b", list(range(200, 216)) + [1])
    assert manager.pool.num_cached == 8
    assert order.evict_cached_beyond(5) == 3
    assert manager.pool.num_cached == 5
    assert _cached(manager, range(100, 116)) == 4  # the older turn lost its three tail pages
    assert order.evict_cached_beyond(5) == 0
