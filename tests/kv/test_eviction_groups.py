"""The group-restricted path of the eviction orders (agentjax/kv/eviction_groups.py)."""
import numpy as np

from agentjax.kv import PinnedEvictionOrder


def test_a_take_after_the_last_pin_is_gone_records_no_stale_pinned_tier_victims():
    order = PinnedEvictionOrder(lambda: 0.0)
    ref_counts = np.zeros(8, dtype=np.int32)
    ref_counts[0] = 1  # the null page
    order.bind(ref_counts)
    order.push_free(np.arange(1, 8, dtype=np.int32))
    order.pin("s", [1, 2])
    first = order.pop_victims(7, allowed=(1, 8))
    assert first.tolist() == [3, 4, 5, 6, 7, 1, 2]  # the pinned pages last, evicted under pressure
    assert order.victim_positions()[:, 1].tolist() == [0] * 7  # generations before the eviction
    assert order.pinned_evictions == 2
    ref_counts[first] = 1
    order.unpin("s")
    ref_counts[first] = 0
    order.push_free(first)
    second = order.pop_victims(3, allowed=(1, 8))
    assert second.tolist() == [3, 4, 5]
    generations = order.pins.generation[second].tolist()
    assert order.victim_positions()[:, 1].tolist() == generations  # not shifted by the first take's tier mask


def test_pinned_pages_that_hold_nothing_are_taken_last_when_only_empty_pages_are_asked_for():
    """A pool asks for pages that hold no block (`page_group`); pinned ones among them are taken after
    every unpinned one instead of never (a pin keeps nothing on an empty page)."""
    order = PinnedEvictionOrder(lambda: 0.0)
    ref_counts = np.zeros(8, dtype=np.int32)
    ref_counts[0] = 1
    order.bind(ref_counts)
    order.push_free(np.arange(1, 8, dtype=np.int32))
    page_group = np.full(8, -1, dtype=np.int16)
    page_group[[3, 4]] = 0  # pages 3 and 4 hold cached blocks
    order.pin("s", [1, 2, 4])
    taken = order.pop_victims(4, allowed=(1, 8), page_group=page_group)
    assert taken.tolist() == [5, 6, 7, 1]  # the unpinned empty pages, then a pinned empty one; never 3 or 4
