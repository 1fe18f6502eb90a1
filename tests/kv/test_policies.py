"""Built-in KV policies (agentjax/kv/policies.py): LRU, hint-aware, Marconi and Belady's MIN, the
last checked against a brute-force optimum through the real KVCacheManager."""
import functools
import math

import numpy as np
import pytest

from agentjax.errors import InvalidRequestError
from agentjax.kv import KVCacheManager
from agentjax.kv.offload.policies import RecomputeCost
from agentjax.kv.policies import BeladyPolicy, HintAwarePolicy, LRUPolicy, MarconiPolicy, make_policy
from agentjax.kv.policy import TurnEnd
from agentjax.kv.policy_order import PolicyEvictionOrder


class Clock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def _policy(cls, num_pages=32, **options):
    clock = Clock()
    policy = cls(clock, **options)
    policy.bind(num_pages)
    return policy, clock


def _end(policy, session, pages, now, **hints):
    """A turn of `session` over `pages` ends at `now` (pages freed tail first, as the pool does)."""
    pages = np.asarray(pages)
    policy.on_free(pages[::-1])
    policy.on_turn_end(TurnEnd(session, pages, now, **hints))


def _victims(policy, count, candidates=None):
    candidates = np.arange(1, policy.num_pages) if candidates is None else np.asarray(candidates)
    return policy.evict_order(candidates, count).tolist()


def test_lru_takes_the_least_recently_freed_turn_tail_first():
    policy, _ = _policy(LRUPolicy)
    _end(policy, "a", [1, 2, 3], 0.0)
    _end(policy, "b", [4, 5], 1.0)
    assert _victims(policy, 4, [1, 2, 3, 4, 5]) == [3, 2, 1, 5]


def test_hints_evict_the_session_expected_farthest_away_first_and_tails_before_heads():
    policy, _ = _policy(HintAwarePolicy)
    _end(policy, "soon", [1, 2, 3], 0.0, expected_next_turn_s=5.0)
    _end(policy, "later", [4, 5, 6], 1.0, expected_next_turn_s=100.0)
    _end(policy, "mid", [7, 8], 2.0, expected_next_turn_s=30.0)
    assert _victims(policy, 8, range(1, 9)) == [6, 5, 4, 8, 7, 3, 2, 1]


def test_hints_evict_an_ended_session_first_even_if_it_was_used_last():
    policy, clock = _policy(HintAwarePolicy)
    _end(policy, "live", [1, 2], 0.0, expected_next_turn_s=1000.0)
    _end(policy, "done", [3, 4], 5.0, session_end=True)
    clock.now = 5.0
    assert _victims(policy, 2, range(1, 5)) == [4, 3]


def test_hints_without_a_hint_expect_the_next_turn_after_the_default():
    policy, clock = _policy(HintAwarePolicy, default_next_turn_s=30.0)
    _end(policy, "quiet", [1], 0.0)  # expected at 30
    _end(policy, "hinted", [2], 0.0, expected_next_turn_s=60.0)
    assert _victims(policy, 1, [1, 2]) == [2]


def test_hints_keep_a_prefix_shared_with_a_subagent_for_the_sooner_of_the_two():
    policy, clock = _policy(HintAwarePolicy)
    _end(policy, "parent", [1, 2, 3], 0.0, expected_next_turn_s=10.0, branch_point=True)
    _end(policy, "other", [9], 1.0, expected_next_turn_s=50.0)
    # The subagent reads the parent's first two pages plus its own page, then ends.
    _end(policy, "child", [1, 2, 4], 2.0, parent_session_id="parent", session_end=True)
    clock.now = 2.0
    # The child's own page goes first; the shared pages count for the parent (next turn at 10).
    assert _victims(policy, 3, [1, 2, 4, 9]) == [4, 9, 2]


def test_hints_evict_pages_the_sessions_latest_turn_left_behind():
    policy, _ = _policy(HintAwarePolicy)
    _end(policy, "s", [1, 2, 3], 0.0, expected_next_turn_s=5.0)
    _end(policy, "s", [1, 5], 1.0, expected_next_turn_s=5.0)  # a compacted context: 2 and 3 left behind
    _end(policy, "t", [6], 1.0, expected_next_turn_s=500.0)
    assert policy.left_behind(np.array([1, 2, 3, 5, 6])).tolist() == [False, True, True, False, False]
    assert _victims(policy, 3, [1, 2, 3, 5, 6]) == [3, 2, 6]


def test_hints_overdue_sessions_count_as_further_away_the_later_they_are():
    imminent, clock = _policy(HintAwarePolicy)
    _end(imminent, "late", [1], 0.0, expected_next_turn_s=10.0)
    _end(imminent, "due", [2], 50.0, expected_next_turn_s=40.0)  # expected at 90
    clock.now = 60.0  # "late" is 50 s overdue: still the sooner one by default
    assert _victims(imminent, 1, [1, 2]) == [2]
    overdue, clock = _policy(HintAwarePolicy, overdue_s_per_s=1.0)
    _end(overdue, "late", [1], 0.0, expected_next_turn_s=10.0)
    _end(overdue, "due", [2], 50.0, expected_next_turn_s=40.0)
    clock.now = 60.0  # "late" now counts as 60 + 50 = 110 s: further than 90
    assert _victims(overdue, 1, [1, 2]) == [1]


def test_hints_prefetch_the_last_turns_keys_once_the_next_turn_is_near():
    policy, clock = _policy(HintAwarePolicy, prefetch_lead_s=5.0)
    policy.on_turn_end(TurnEnd("s", np.array([1, 2]), 0.0, expected_next_turn_s=20.0, keys=["k1", "k2"]))
    assert policy.prefetch("s") == [] and policy.sessions_due(0.0, 5.0) == []
    clock.now = 16.0
    assert policy.prefetch("s") == ["k1", "k2"] and policy.sessions_due(16.0, 5.0) == ["s"]
    policy.on_turn_end(TurnEnd("s", np.array([1, 2]), 17.0, session_end=True, keys=["k1", "k2"]))
    assert policy.prefetch("s") == [] and policy.prefetch("unknown") == []


def test_marconi_keeps_reused_content_over_slightly_newer_content_seen_once():
    policy, _ = _policy(MarconiPolicy, reuse_bonus=1.0)
    _end(policy, "a", [1, 2], 0.0)
    _end(policy, "a", [1, 2], 1.0)  # seen by a second turn
    _end(policy, "b", [3, 4], 2.0)  # newer, seen once
    _end(policy, "c", [5, 6], 3.0)  # newest
    assert _victims(policy, 2, range(1, 7)) == [4, 3]
    plain, _ = _policy(MarconiPolicy, reuse_bonus=0.0)
    for session, pages, now in (("a", [1, 2], 0.0), ("a", [1, 2], 1.0), ("b", [3, 4], 2.0), ("c", [5, 6], 3.0)):
        _end(plain, session, pages, now)
    assert _victims(plain, 2, range(1, 7)) == [2, 1]  # without the bonus: LRU


def test_marconi_flop_weight_keeps_pages_that_cost_more_to_recompute():
    cost = RecomputeCost(active_params=1e6, attention_flops_per_pair=1e6)
    policy, _ = _policy(MarconiPolicy, reuse_bonus=0.0, flop_weight=10.0,
                        flops_per_byte=cost.block_scorer(block_tokens=64, block_bytes=1024))
    _end(policy, "long", [1, 2, 3, 4], 0.0)  # deep positions: attention makes them dear
    _end(policy, "short", [5], 1.0)
    assert _victims(policy, 1, [4, 5]) == [5]
    with pytest.raises(InvalidRequestError, match="flops_per_byte"):
        MarconiPolicy(Clock(), flop_weight=1.0)


def test_make_policy_names_the_choices_on_an_unknown_name():
    assert isinstance(make_policy("hints", Clock()), HintAwarePolicy)
    with pytest.raises(InvalidRequestError, match="lru, hints, marconi, belady"):
        make_policy("fifo", Clock())


# -- Belady through the real manager against a brute-force optimum ----------------------------------

SEQUENCE = [1, 2, 3, 1, 4, 2, 1, 3, 4, 2, 5, 1, 3, 2]
SENTINEL = 99  # never cached: every block of a request can hit


def _replay_single_blocks(policy_name, sequence, capacity):
    """Each request reads one block; it hits if resident, becomes resident, then the policy evicts
    down to `capacity` blocks (possibly the block just read). Returns the hit count."""
    clock = Clock()
    policy = make_policy(policy_name, clock)
    order = PolicyEvictionOrder(policy)
    manager = KVCacheManager.full_attention(num_blocks=capacity + 3, block_size=1, cache_on_allocate=False,
                                            eviction_order=order, clock=clock)
    hits = 0
    for index, block in enumerate(sequence):
        clock.now = float(index)
        manager.allocate(f"r{index}", [block, SENTINEL])
        hits += manager.num_cached_tokens(f"r{index}")
        manager.cache_blocks(f"r{index}", 1)
        pages = np.asarray(manager.block_ids(f"r{index}")[0][:1])
        manager.free(f"r{index}")
        policy.on_turn_end(TurnEnd(f"s{block}", pages, clock.now))
        if isinstance(policy, BeladyPolicy):
            following = [j for j in range(index + 1, len(sequence)) if sequence[j] == block]
            policy.set_next_use(pages, np.asarray([following[0] if following else math.inf]))
        order.evict_cached_beyond(capacity)
        manager.check_invariants()
    return hits


def _optimal_hits(sequence, capacity):
    @functools.lru_cache(maxsize=None)
    def best(index, resident):
        if index == len(sequence):
            return 0
        block = sequence[index]
        hit = int(block in resident)
        after = resident | {block}
        if len(after) <= capacity:
            return hit + best(index + 1, after)
        return hit + max(best(index + 1, after - {victim}) for victim in after)

    return best(0, frozenset())


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_belady_through_the_manager_reaches_the_brute_force_optimum(capacity):
    optimum = _optimal_hits(SEQUENCE, capacity)
    assert _replay_single_blocks("belady", SEQUENCE, capacity) == optimum
    assert _replay_single_blocks("lru", SEQUENCE, capacity) <= optimum


def test_belady_takes_the_farthest_next_use_then_the_deepest_block():
    policy, _ = _policy(BeladyPolicy)
    _end(policy, "a", [1, 2, 3], 0.0)
    policy.set_next_use(np.array([1, 2, 3]), np.array([5.0, 5.0, 5.0]))
    _end(policy, "b", [4, 5], 1.0)
    policy.set_next_use(np.array([4, 5]), np.array([9.0, math.inf]))
    assert _victims(policy, 5, range(1, 6)) == [5, 4, 3, 2, 1]


def test_hints_rank_pages_before_any_session_has_ended_a_turn_least_recently_freed_first():
    policy, _ = _policy(HintAwarePolicy)  # sessionless requests only (LLM.generate without session ids)
    policy.on_free(np.asarray([3, 2, 1]))
    policy.on_free(np.asarray([5, 4]))
    assert _victims(policy, 5, [1, 2, 3, 4, 5]) == [3, 2, 1, 5, 4]
