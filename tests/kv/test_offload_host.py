"""The host tier's index (agentjax/kv/offload/host.py): slots per group, least recently used first or by score."""
from __future__ import annotations

import pytest

from agentjax.errors import OffloadTierError
from agentjax.kv.offload.host import HostPageIndex


def test_slots_are_handed_out_per_group_and_slot_zero_never():
    index = HostPageIndex(num_groups=2, num_slots=4)
    assert [index.assign((0, bytes([i]))) for i in range(3)] == [1, 2, 3]
    assert index.assign((1, b"\x00")) == 1  # groups have their own slots
    assert index.assign((0, b"\x01")) == 2  # a key keeps its slot
    assert len(index) == 4


def test_a_full_group_evicts_its_least_recently_used_key():
    index = HostPageIndex(num_groups=1, num_slots=4)
    for i in range(3):
        index.assign((0, bytes([i])))
    index.touch((0, b"\x00"))
    slot = index.assign((0, b"\x09"))
    assert slot == 2 and not index.contains((0, b"\x01")) and index.contains((0, b"\x00"))
    assert index.evictions == 1
    index.drop((0, b"\x00"))
    assert index.assign((0, b"\x0a")) == 1  # a dropped key's slot is free again


def test_a_pool_too_small_for_one_page_is_a_start_up_error():
    with pytest.raises(OffloadTierError, match="host_cache_gb"):
        HostPageIndex(num_groups=1, num_slots=1)


def test_one_store_never_gives_two_of_its_rows_the_same_slot():
    index = HostPageIndex(num_groups=1, num_slots=4, scored=True)  # 3 usable slots
    index.assign((0, b"kept"), 100.0)  # costly to recompute: outlives the store's cheap pages
    hashes = [b"a", b"b", b"c", b"d", b"kept"]
    slots = index.assign_many(0, hashes, [1.0, 1.0, 1.0, 1.0, 1.0])
    given = [slot for slot in slots if slot]
    assert len(given) == len(set(given)) == 2  # a and b were evicted again by c and d: their rows are dropped
    assert slots[0] == slots[1] == 0 and slots[4] == 0  # "kept" was held already
    for block_hash, slot in zip(hashes, slots):
        if slot:
            assert index.slot((0, block_hash)) == slot
    assert index.contains((0, b"kept")) and not index.contains((0, b"a"))


def test_a_store_into_free_slots_takes_them_in_order_and_scores_its_keys():
    index = HostPageIndex(num_groups=1, num_slots=6, scored=True)  # 5 usable slots
    assert index.assign_many(0, [b"a", b"b", b"c"], [5.0, 1.0, 3.0]) == [1, 2, 3]
    assert index.assign_many(0, [b"d", b"e", b"a"], [4.0, 2.0, 5.0]) == [4, 5, 0]  # "a" is held already
    assert index.assign((0, b"f"), 9.0) == 2  # full: the lowest score, "b", gives its slot up
    assert not index.contains((0, b"b")) and len(index) == 5


def test_a_store_given_a_callable_for_its_scores_calls_it_only_to_choose_a_victim():
    index = HostPageIndex(num_groups=1, num_slots=6, scored=True)  # 5 usable slots
    calls = []

    def scores(values):
        return lambda: calls.append(values) or values

    assert index.assign_many(0, [b"a", b"b", b"c"], scores([5.0, 1.0, 3.0])) == [1, 2, 3]
    assert index.assign_many(0, [b"d", b"e"], scores([4.0, 2.0])) == [4, 5]
    assert calls == []  # free slots: no score was needed
    assert index.assign_many(0, [], scores([])) == [] and len(index) == 5  # an empty store changes nothing
    assert index.assign_many(0, [b"f", b"g"], scores([9.0, 9.0])) == [2, 5]  # "b" then "e" give their slots up
    assert calls == [[9.0, 9.0], [5.0, 1.0, 3.0], [4.0, 2.0]]
    assert not index.contains((0, b"b")) and not index.contains((0, b"e")) and len(index) == 5


@pytest.mark.parametrize("scored", [False, True])
def test_a_store_with_a_held_or_repeated_key_and_room_to_spare_leaves_no_slot_taken_twice(scored):
    index = HostPageIndex(num_groups=1, num_slots=10, scored=scored)  # 9 usable slots
    assert index.assign_many(0, [b"a", b"b"], [1.0, 1.0]) == [1, 2]
    slots = index.assign_many(0, [b"c", b"a", b"d", b"c"], [1.0] * 4)  # "a" is held, "c" comes twice
    assert slots == [3, 0, 4, 0] and len(index) == 4
    assert [index.slot((0, key)) for key in (b"a", b"b", b"c", b"d")] == [1, 2, 3, 4]
    # the slots the undone fast path proposed are free again, each once
    rest = index.assign_many(0, [bytes([i]) for i in range(5)], [1.0] * 5)
    assert sorted(rest) == [5, 6, 7, 8, 9] and index.evictions == 0
