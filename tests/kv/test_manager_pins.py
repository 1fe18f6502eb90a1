"""Tests of session and branch pins (PinnedEvictionOrder in agentjax/kv/pinned_order.py, over agentjax/kv/pins.py, driven through
agentjax/kv/manager.py): pinned free pages go after every unpinned one, expire, and are released."""
import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv import KVCacheManager, LRUEvictionOrder
from agentjax.kv.eviction import NULL_PAGE, distinct_pages


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _manager(num_blocks=21, **options):
    clock = Clock()
    return KVCacheManager.full_attention(num_blocks=num_blocks, block_size=4, clock=clock, **options), clock


def _turn(m, req_id, tokens, **free_options):
    assert m.allocate(req_id, tokens) and m.append(req_id, [9])
    m.free(req_id, **free_options)


SESSION = list(range(500, 516))  # 4 full pages


def _load(m, start, pages):
    """A competing request that needs `pages` fresh pages, then finishes."""
    _turn(m, f"load{start}", list(range(start, start + 4 * pages - 1)))


def test_pinned_session_pages_survive_a_load_that_evicts_every_unpinned_page():
    m, _ = _manager()
    _turn(m, "s1", SESSION, pin_session="s", ttl_s=5.0)
    _turn(m, "other", list(range(600, 616)))  # freed later: LRU would evict the session before it
    assert m.stats()["pinned_blocks"] == 4 and m.stats()["pinned_free_blocks"] == 4
    _load(m, 1000, 15)  # 10 never-used pages, the session's uncached tail page, 4 of the other's
    assert m.lookup(SESSION + [1]) == 16
    unpinned, _ = _manager()
    _turn(unpinned, "s1", SESSION)
    _turn(unpinned, "other", list(range(600, 616)))
    _load(unpinned, 1000, 15)
    assert unpinned.lookup(SESSION + [1]) == 0  # without the pin, LRU evicts the session first


def test_pinned_pages_still_count_as_free_and_go_when_nothing_else_is_left():
    m, _ = _manager()
    _turn(m, "s1", SESSION, pin_session="s", ttl_s=5.0)
    assert m.num_free_blocks == 20
    _load(m, 1000, 18)  # needs 2 of the pinned pages
    stats = m.stats()
    assert stats["pinned_evictions"] == 2 and stats["pinned_blocks"] == 2
    m.check_invariants()


def test_an_expired_pin_is_plain_lru_again():
    m, clock = _manager()
    _turn(m, "s1", SESSION, pin_session="s", ttl_s=5.0)
    _load(m, 1000, 2)  # freed after the session: the session is least recently used
    clock.now += 5.0
    assert m.stats()["pinned_blocks"] == 0
    _load(m, 2000, 18)  # the 13 never-used pages, then the session's 5 (least recently freed)
    assert m.lookup(SESSION + [1]) == 0


def test_unpin_releases_at_once_and_a_new_turn_replaces_the_pin_set():
    m, _ = _manager()
    _turn(m, "s1", SESSION, pin_session="s", ttl_s=60.0)
    assert m.stats()["pinned_blocks"] == 4
    second = SESSION[:8] + list(range(600, 612))  # the next turn shares two pages
    _turn(m, "s2", second, pin_session="s", ttl_s=60.0)
    assert m.stats()["pinned_blocks"] == 5  # the new turn's 5 full pages only
    assert m.unpin_session("s") == 5 and m.stats()["pinned_blocks"] == 0
    assert m.unpin("s") == 0


def test_among_pinned_pages_the_earliest_expiry_goes_first():
    m, _ = _manager()
    a, b = list(range(700, 716)), list(range(800, 816))
    _turn(m, "a", a, pin_session="late", ttl_s=50.0)
    _turn(m, "b", b, pin_session="early", ttl_s=10.0)
    _load(m, 1000, 16)  # 12 unpinned pages, then 4 pinned: b's (earliest expiry), tail first
    assert m.lookup(a + [1]) == 16 and m.lookup(b + [1]) == 0


def test_a_branch_point_pin_holds_without_expiry_until_released():
    m, clock = _manager()
    fork = list(range(900, 916))
    _turn(m, "parent", fork + [1, 2, 3])
    assert m.pin_prefix(("branch", "parent"), fork) == 4
    clock.now += 1e6
    _load(m, 1000, 16)
    assert m.lookup(fork + [5]) == 16
    assert m.unpin(("branch", "parent")) == 4
    _load(m, 2000, 16)
    assert m.lookup(fork + [5]) == 0


def test_pins_on_held_pages_protect_them_once_freed_and_expiry_is_checked_on_the_clock():
    m, clock = _manager()
    assert m.allocate("s1", SESSION) and m.append("s1", [1])
    assert m.pin_request("s", "s1", expires_at=clock.now + 1.0) == 4
    m.free("s1")
    _load(m, 1000, 16)
    assert m.lookup(SESSION + [1]) == 16
    clock.now += 2.0
    assert m.stats()["pinned_blocks"] == 0


def test_rolling_back_an_admission_that_evicted_pinned_pages_restores_their_pins():
    m, _ = _manager()
    _turn(m, "s1", SESSION, pin_session="s", ttl_s=60.0)
    order = m.pool.eviction_order
    before = (order.live_pages_in_order().tolist(), m.stats()["pinned_blocks"], dict(m.pool.cached[0]))
    assert m.allocate("big", list(range(3000, 3072)))  # 18 pages: 2 pinned ones evicted
    assert m.stats()["pinned_blocks"] == 2
    assert m.append("big", [7] * 100) is False
    m.free("big")
    assert (order.live_pages_in_order().tolist(), m.stats()["pinned_blocks"], dict(m.pool.cached[0])) == before
    m.check_invariants()


def test_bad_pin_arguments_name_the_value():
    m, _ = _manager()
    with pytest.raises(InvalidRequestError, match="ttl_s must be >= 0"):
        m.pin_prefix("k", [1, 2, 3, 4], ttl_s=-1.0)
    with pytest.raises(InvalidRequestError, match="not both"):
        m.pin_prefix("k", [1, 2, 3, 4], ttl_s=1.0, expires_at=5.0)
    plain = KVCacheManager.full_attention(num_blocks=8, block_size=4, eviction_order=LRUEvictionOrder())
    with pytest.raises(InvalidRequestError, match="has no pins"):
        plain.pin("k", [1])


def test_a_pin_set_is_the_distinct_real_pages_ascending():
    rng = np.random.default_rng(0)
    for size in (0, 1, 2, 7, 300):
        for _ in range(50):
            pages = rng.integers(0, 40, size)
            expected = np.unique(pages)
            assert distinct_pages(pages).tolist() == expected[expected != NULL_PAGE].tolist()
    assert distinct_pages([5, 0, 5, 2], np.int32).dtype == np.int32
