"""Retention policies, the recompute cost model and the tiers' eviction score (agentjax/kv/offload/policies.py),
with the host and disk tiers choosing victims by that score."""
import gc

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv.offload.disk import HEADER, DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.policies import (GreedyDualOrder, GroupEntries, IntervalRetention, MarconiRetention,
                                          RecomputeCost, TierEntryScore, make_retention)


def test_interval_retention_stores_every_block_or_the_state_at_the_prompts_end():
    assert IntervalRetention().select(["a", "b", "c"]).tolist() == [0, 1, 2]
    assert IntervalRetention(checkpoint=True).select(["a", "b", "c"]).tolist() == [2]
    assert IntervalRetention(checkpoint=True).select([]).tolist() == []


def test_marconi_retention_stores_a_prefix_once_a_second_turn_shares_it():
    retention = MarconiRetention()
    assert retention.select(["a", "b", "c"]).tolist() == []  # first sight: nothing
    assert retention.select(["a", "b", "c", "d"]).tolist() == [0, 1, 2]  # seen twice: the shared prefix
    assert retention.select(["a", "x"]).tolist() == [0]
    assert retention.select(np.array([7, 8])).tolist() == []  # numpy keys work too
    assert retention.select(["p", "q"], branch_point=True).tolist() == [0, 1]  # a branch point: everything


def test_marconi_retention_keeps_one_checkpoint_at_the_fork_point_for_states():
    retention = MarconiRetention(checkpoint=True)
    retention.select(["a", "b", "c"])
    assert retention.select(["a", "b", "z"]).tolist() == [1]
    assert retention.select(["n"], branch_point=True).tolist() == [0]


def test_marconi_retention_forgets_the_oldest_keys_beyond_its_bound():
    retention = MarconiRetention(max_keys=2)
    retention.select(["a", "b", "c"])  # remembers b, c
    assert retention.select(["a", "b"]).tolist() == []  # "a" was forgotten: no shared prefix
    with pytest.raises(InvalidRequestError, match="max_keys"):
        MarconiRetention(max_keys=0)


def test_make_retention_by_name():
    assert isinstance(make_retention("interval"), IntervalRetention)
    assert isinstance(make_retention("marconi", checkpoint=True), MarconiRetention)
    with pytest.raises(InvalidRequestError, match="interval or marconi"):
        make_retention("always")


def test_recompute_cost_counts_linear_and_attention_flops():
    cost = RecomputeCost(active_params=10, attention_flops_per_pair=2)
    # tokens 3 and 4 with 3 cached: 2*10*2 linear + 2 * (2*3 + 2*3/2) attention pairs
    assert float(cost.token_flops(3, 2)) == 58.0
    assert float(cost.flops_per_byte(3, 2, entry_bytes=4)) == 14.5
    # a state checkpoint after 5 tokens saves the whole prefix: 2*10*5 + 2 * 15
    assert float(cost.flops_per_byte(3, 2, entry_bytes=4, checkpoint=True)) == 32.5
    assert RecomputeCost.for_model(1e9, num_attention_layers=2, num_heads=4, head_dim=8).attention_flops_per_pair == 256
    scorer = cost.block_scorer(block_tokens=2, block_bytes=4)
    assert scorer(np.array([0, 1])).tolist() == [float(cost.token_flops(0, 2)) / 4, float(cost.token_flops(2, 2)) / 4]
    with pytest.raises(InvalidRequestError, match="entry_bytes"):
        cost.flops_per_byte(0, 1, entry_bytes=0)
    with pytest.raises(InvalidRequestError, match="active_params"):
        RecomputeCost(-1, 0)


COST = RecomputeCost(active_params=1e6, attention_flops_per_pair=1e3)


def test_tier_entry_score_weighs_heads_states_and_compressed_entries_against_their_bytes():
    kv_page, state, compressed = GroupEntries(16, 4096), GroupEntries(16, 4096, checkpoint=True), GroupEntries(64, 4096)
    score = TierEntryScore(COST, [kv_page, state, compressed])
    # A KV page saves the rest of its turn (a hit stops at the first missing page): heads before tails.
    assert score(0, 0, 8) > score(0, 4, 8) > score(0, 7, 8)
    assert score(0, 7, 8) == pytest.approx(COST.token_flops(7 * 16, 16) / 4096)
    # A state checkpoint saves its whole prefix, so a late one outweighs the KV page beside it.
    assert score(1, 7, 8) == pytest.approx(COST.token_flops(0, 8 * 16) / 4096)
    assert score(1, 7, 8) > score(0, 7, 8)
    # A compressed entry covers 4x the tokens in the same bytes.
    assert score(2, 7, 8) > 3 * score(0, 7, 8)
    with pytest.raises(InvalidRequestError, match="bytes_per_page"):
        TierEntryScore(COST, [GroupEntries(16, 0)])


def test_greedy_dual_evicts_the_lowest_score_first_and_is_lru_among_equals():
    order = GreedyDualOrder()
    for key, score in (("a", 1.0), ("b", 1.0), ("state", 5.0), ("c", 1.0)):
        order.add(key, score)
    order.touch("a")  # used again: it goes after b and c
    assert [order.pop(), order.pop(), order.pop()] == ["b", "c", "a"]
    assert order.inflation == 1.0  # the last victim's priority
    for key in ("d", "e", "f"):  # newer cheap entries go before the state while its score covers
        order.add(key, 1.0)
        assert order.pop() == key
    assert "state" in order and order.inflation == 4.0
    order.add("h", 2.0)
    assert order.pop() == "state"  # its priority (0 + 5) is now below h's (4 + 2)
    order.remove("h")
    with pytest.raises(KeyError):
        order.pop()


def test_greedy_dual_add_many_orders_victims_as_one_add_per_key_with_scores_given_or_called_for():
    rng = np.random.default_rng(3)
    batched, one_by_one, called = GreedyDualOrder(), GreedyDualOrder(), GreedyDualOrder()
    calls, victims = [], {id(batched): [], id(one_by_one): [], id(called): []}
    for round_ in range(80):
        keys = [f"k{round_}-{i}" for i in range(int(rng.integers(1, 12)))]
        scores = [float(s) if s > 0.3 else 0.0 for s in rng.random(len(keys)) * 4]  # ties too
        batched.add_many(keys, scores)
        called.add_many(keys, lambda round_=round_, scores=scores: calls.append(round_) or scores)
        for key, score in zip(keys, scores):
            one_by_one.add(key, score)
        if round_ < 20:  # nothing popped or touched yet: the callables wait
            assert calls == []
            continue
        pops = int(rng.integers(0, 4))
        for order in (batched, one_by_one, called):
            order.touch(keys[0])
            if round_ % 5 == 0:
                order.remove(keys[-1])
            victims[id(order)] += [order.pop() for _ in range(pops) if len(order)]
    assert victims[id(batched)] == victims[id(one_by_one)] == victims[id(called)] and len(victims[id(batched)]) > 30
    assert batched.inflation == one_by_one.inflation == called.inflation
    assert len(batched) == len(one_by_one) == len(called)
    assert 0 < len(calls) == len(set(calls))  # each callable ran once at most
    with pytest.raises(InvalidRequestError, match="score >= 0"):
        batched.add_many(["x", "y"], [1.0, float("nan")])
    with pytest.raises(InvalidRequestError, match="score >= 0"):
        batched.add_many(["x"], [-1.0])
    assert "x" not in batched


def test_greedy_dual_calls_a_batch_s_score_callable_only_for_a_victim_and_checks_what_it_gives():
    order, calls = GreedyDualOrder(), []
    order.add_many([], lambda: calls.append("empty") or [])  # an empty batch: nothing waits
    order.add_many(["a", "b"], lambda: calls.append("ab") or [2.0, 1.0])
    order.add_many(["c"], lambda: calls.append("c") or [3.0])
    assert calls == [] and len(order) == 3 and "b" in order
    assert order.pop() == "b" and calls == ["ab", "c"]
    order.add_many([], lambda: [])  # once evicting too
    assert len(order) == 2 and order.pop() == "a"
    bad = GreedyDualOrder()
    bad.add_many(["x", "y"], lambda: [1.0, float("nan")])
    with pytest.raises(InvalidRequestError, match="score >= 0"):  # checked when it is called
        bad.pop()


def test_greedy_dual_keeps_its_stale_entries_bounded_when_nothing_is_evicted():
    order = GreedyDualOrder()
    order.add_many([f"k{i}" for i in range(10)], [1.0] * 10)
    for i in range(10_000):  # a tier with free slots: entries are refreshed, none is ever popped
        order.touch(f"k{i % 10}")
    assert len(order._heap) + order._num_waiting <= 4 * len(order) + 64 + 1
    assert [order.pop() for _ in range(3)] == ["k0", "k1", "k2"]  # the least recently touched first


def test_a_scored_host_group_evicts_its_cheapest_entry_not_its_oldest():
    host = HostPageIndex(num_groups=1, num_slots=4)  # 3 usable slots
    scored = HostPageIndex(num_groups=1, num_slots=4, scored=True)
    for index in (host, scored):
        index.assign((0, b"head"), 9.0)  # oldest, but costly to recompute
        index.assign((0, b"tail"), 1.0)
        index.assign((0, b"middle"), 4.0)
        index.assign((0, b"new"), 1.0)  # full: one goes
    assert not host.contains((0, b"head")) and host.contains((0, b"tail"))  # LRU: the oldest
    assert scored.contains((0, b"head")) and not scored.contains((0, b"tail"))  # the lowest score
    scored.drop((0, b"middle"))
    assert scored.assign((0, b"x"), 1.0) == scored.slot((0, b"x")) and len(scored) == 3


def test_a_scored_disk_tier_evicts_its_cheapest_page_file_under_the_cap(tmp_path):
    payload = bytes(1000)
    tier = DiskTier(tmp_path, "ns", capacity_bytes=3 * (HEADER.size + 1000), scored=True)
    tier.write((0, b"s" * 32), payload, score=50.0)  # a state checkpoint: oldest, but worth keeping
    tier.write((0, b"t" * 32), payload, score=1.0)
    tier.write((1, b"c" * 32), payload, score=20.0)
    tier.write((0, b"n" * 32), payload, score=2.0)  # over the cap: the cheapest file goes
    assert tier.contains((0, b"s" * 32)) and tier.contains((1, b"c" * 32)) and tier.contains((0, b"n" * 32))
    assert not tier.contains((0, b"t" * 32)) and not (tmp_path / "ns" / "g0" / f"{(b't' * 32).hex()}.kvp").exists()
    restarted = DiskTier(tmp_path, "ns", capacity_bytes=3 * (HEADER.size + 1000), scored=True)
    assert len(restarted) == 3  # the index is rebuilt from the files; their scores start at 0


def test_greedy_dual_batches_waiting_for_a_victim_keep_touches_removals_and_order():
    order = GreedyDualOrder()
    order.add_many(["a0", "a1", "a2"], [3.0, 1.0, 2.0])
    order.add_many(["b0", "b1"], [1.0, 0.5])
    order.touch("a1")  # touched and removed while still waiting in their batches
    order.remove("b0")
    order.add("a2", 0.25)  # refreshed with a new score: its first entry is stale
    # Nothing was popped: no heap, and the key index holds plain numbers the collector does not track.
    assert order._heap == [] and not gc.is_tracked(order._live)
    assert len(order) == 4 and "b0" not in order and "a1" in order
    assert [order.pop() for _ in range(2)] == ["a2", "b1"]  # priorities 0.25, 0.5
    order.add_many(["c0"], [0.1])  # a batch after the heap exists: inflation is 0.5 now
    assert [order.pop() for _ in range(3)] == ["c0", "a1", "a0"]  # priorities 0.6, 1 (touched at inflation 0), 3
    assert order.inflation == 3.0 and len(order) == 0
    with pytest.raises(KeyError):
        order.pop()


def test_greedy_dual_indexes_add_many_batches_only_when_another_call_needs_them():
    lazy, eager = GreedyDualOrder(), GreedyDualOrder()
    batches = [(["a", "b", "c"], [2.0, 1.0, 3.0]), (["d", "b"], [0.5, 4.0]), (["e"], [0.0])]  # "b" re-added
    for keys, scores in batches:
        lazy.add_many(keys, scores)
        for key, score in zip(keys, scores):
            eager.add(key, score)
    assert lazy._live == {} and lazy._num_waiting == 6  # a filling tier: one append per store, no key index
    assert len(lazy) == len(eager) == 5 and "b" in lazy  # counted once: its later entry is the live one
    lazy.add_many(["f"], [0.25])
    lazy.touch("a")  # a touch indexes the waiting batches first, in order
    eager.add("f", 0.25)
    eager.touch("a")
    assert [lazy.pop() for _ in range(6)] == [eager.pop() for _ in range(6)] == ["e", "f", "d", "a", "c", "b"]


def test_greedy_dual_pop_add_is_a_pop_then_an_add():
    rng = np.random.default_rng(7)
    combined, separate = GreedyDualOrder(), GreedyDualOrder()
    first = [float(s) for s in rng.random(20).round(1)]
    for order in (combined, separate):
        order.add_many([f"k{i}" for i in range(20)], first)
    for step in range(200):
        key, score = f"n{step}", round(float(rng.random()), 1)  # ties too
        if step % 7 == 0:  # stale entries on the heap's top: touched and removed keys
            for order in (combined, separate):
                order.touch(f"n{step - 1}" if step else "k0")
                order.remove(f"n{step - 3}")
        victim = separate.pop()
        separate.add(key, score)
        assert combined.pop_add(key, score) == victim
        assert combined.inflation == separate.inflation and len(combined) == len(separate)
    with pytest.raises(InvalidRequestError, match="score must be >= 0"):
        combined.pop_add("x", -1.0)
    assert "x" not in combined
