"""The KV cache's one pin table (agentjax/kv/pins.py): pin sets by key, expiry, evictions and their undo,
and the same table under the default eviction order and under every KV policy."""
import math

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv import PinnedEvictionOrder, PolicyEvictionOrder
from agentjax.kv.pins import PinTable
from agentjax.kv.policies import make_policy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Recorder:
    def __init__(self):
        self.calls = []

    def pins_grew(self, pages):
        self.calls.append(("grew", pages.tolist()))

    def pins_released(self, released, still):
        self.calls.append(("released", released.tolist(), still.tolist()))


def table(num_pages=16):
    clock = Clock()
    pins = PinTable(clock)
    pins.bind(num_pages)
    return pins, clock


def test_a_pin_set_is_replaced_by_key_and_pages_two_keys_hold_stay_pinned_until_both_go():
    pins, _ = table()
    assert pins.pin("a", [3, 1, 3, 0, 2]) == 3  # distinct, the null page left out
    assert pins.pin("b", [2, 5], expires_at=10.0) == 2
    assert pins.count[[1, 2, 3, 5]].tolist() == [1, 2, 1, 1]
    assert pins.expiry[2] == math.inf and pins.expiry[5] == 10.0
    assert pins.pin("a", [4]) == 1  # replaces a's set
    assert pins.count[[1, 2, 3, 4]].tolist() == [0, 1, 0, 1]
    assert pins.expiry[2] == 10.0  # only b holds it now
    assert pins.unpin("b") == 2 and pins.unpin("b") == 0
    assert pins.num_pinned() == (1, 0) and pins.keys() == ["a"]


def test_a_pin_expires_on_the_clock_and_one_already_past_pins_nothing():
    pins, clock = table()
    pins.pin("soon", [1, 2], expires_at=5.0)
    pins.pin("late", [2, 3], expires_at=9.0)
    assert pins.pin("past", [4], expires_at=0.0) == 0 and "past" not in pins
    clock.now = 6.0
    assert pins.pinned_mask(np.array([1, 2, 3])).tolist() == [False, True, True]
    assert pins.get("soon") is None and pins.get("late").expires_at == 9.0
    clock.now = 9.0
    pins.expire()
    assert not pins.active and pins.num_pinned() == (0, 0)


def test_bad_pins_are_refused():
    pins, _ = table(8)
    with pytest.raises(InvalidRequestError, match="NaN"):
        pins.pin("k", [1], expires_at=float("nan"))
    with pytest.raises(InvalidRequestError, match=r"\[1, 8\)"):
        pins.pin("k", [1, 8])
    with pytest.raises(InvalidRequestError, match=r"\[1, 8\)"):
        pins.pin("k", [-2, 3])


def test_an_eviction_ends_the_pins_of_its_pages_and_undoing_it_restores_them():
    pins, _ = table()
    pins.pin("a", [1, 2], expires_at=7.0)
    pins.pin("b", [2, 3])
    before = pins.generation[[2, 3]].copy()
    pins.evicted(np.array([2, 4]))
    assert pins.pinned_evictions == 1  # page 4 held no pin
    assert pins.count[[1, 2, 3]].tolist() == [1, 0, 1]
    assert pins.unpin("b") == 1  # page 2's content is gone: b protects only page 3 now
    pins.pin("b", [2, 3])  # a new pin of the new content
    pins.unpin("b")
    pins.pin("b", [3])
    pins.restore_generations(np.array([2, 3]), before)  # the eviction of page 2 undone
    assert pins.count[2] == 1 and pins.expiry[2] == 7.0  # a's pin holds it again


def test_the_listener_hears_grown_expiries_and_released_pages():
    pins, _ = table()
    heard = pins.listener = Recorder()
    pins.pin("a", [1, 2], expires_at=5.0)
    pins.pin("b", [2, 3], expires_at=4.0)  # page 2 keeps a's later expiry
    pins.unpin("a")
    assert heard.calls == [("grew", [1, 2]), ("grew", [3]), ("released", [1], [2])]
    assert pins.expiry[2] == 4.0


@pytest.mark.parametrize("name", [None, "lru", "hints", "marconi", "belady"])
def test_every_eviction_order_and_policy_keeps_its_pins_in_one_pin_table(name):
    clock = Clock()
    order = PinnedEvictionOrder(clock) if name is None else PolicyEvictionOrder(make_policy(name, clock))
    order.bind(np.zeros(8, dtype=np.int32))
    assert isinstance(order.pins, PinTable)
    assert order.pin("s", [1, 2], expires_at=3.0) == 2
    assert order.pinned_mask(np.array([1, 2, 3])).tolist() == [True, True, False]
    assert order.num_pinned() == (2, 2) and order.pins.count[[1, 2]].tolist() == [1, 1]
    clock.now = 3.0
    assert order.num_pinned() == (0, 0) and not order.pins.active
