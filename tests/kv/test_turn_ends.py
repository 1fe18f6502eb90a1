"""Tests of agentjax/kv/turn_ends.py through the manager: the state a turn ended with, and its partial
last attention page, are hit by the next turn's prompt and copied into pages of its own."""
from agentjax.kv import FullAttentionSpec, KVCacheManager, RecurrentStateSpec, SlidingWindowSpec

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)
STATE = RecurrentStateSpec(bytes_per_state=128, checkpoint_interval=8)


def _manager(specs=(FULL, STATE), num_blocks=64):
    return KVCacheManager.from_specs(list(specs), num_blocks, block_size=4, cache_on_allocate=False)


def _turn(m, req_id, tokens, computed):
    assert m.allocate(req_id, tokens)
    m.reserve_state_saves(req_id, m.num_cached_tokens(req_id), computed)
    m.cache_blocks(req_id, computed)
    m.take_pending_copies()
    return m.block_ids(req_id)


def test_the_next_turn_resumes_at_the_last_token_the_model_consumed():
    m = _manager()
    turn = list(range(19))  # 17 prompt tokens and 2 outputs: the model consumed 18
    full, state = _turn(m, "a", turn, 18)
    assert m.end_turn("a", 18)
    m.free("a")
    follow_up = turn + [50, 51, 52]
    assert m.lookup(follow_up) == 18
    assert m.allocate("b", follow_up) and m.num_cached_tokens("b") == 18
    full_b, state_b = m.block_ids("b")
    assert full_b[:4] == full[:4] and full_b[4] not in full  # the partial page is copied, not shared
    copies = sorted(m.take_pending_copies())
    assert copies == [(0, full[4], full_b[4]), (1, state[0], state_b[0])]
    m.check_invariants()


def test_a_prompt_that_differs_inside_the_partial_page_falls_back_to_the_checkpoint():
    m = _manager()
    turn = list(range(19))
    _turn(m, "a", turn, 18)
    m.end_turn("a", 18)
    m.free("a")
    assert m.lookup(turn[:17] + [77, 78, 79]) == 16
    assert m.lookup(turn[:18]) == 16  # the turn end is its last token: never a hit
    assert m.lookup(turn[:18] + [5]) == 18


def test_a_turn_that_ends_on_a_checkpoint_saves_nothing_new():
    m = _manager()
    _turn(m, "a", list(range(17)), 16)
    assert not m.end_turn("a", 16)
    m.free("a")
    assert m.lookup(list(range(17)) + [3]) == 16


def test_an_aborted_admission_rolls_back_a_turn_end_hit_exactly():
    m = _manager()
    turn = list(range(19))
    _turn(m, "a", turn, 18)
    m.end_turn("a", 18)
    m.free("a")
    before = (m.num_free_blocks, m.stats()["hits"])
    assert m.allocate("b", turn + [1, 2]) and m.num_cached_tokens("b") == 18
    m.free("b")  # uncommitted: rolled back, copies dropped
    assert (m.num_free_blocks, m.stats()["hits"]) == before and m.take_pending_copies() == []
    assert m.lookup(turn + [1, 2]) == 18
    m.check_invariants()


def test_models_with_a_window_group_keep_turn_ends_off():
    sliding = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=8)
    assert _manager((FULL, sliding, STATE)).turn_ends is None
    assert _manager((FULL, STATE)).turn_ends is not None


def test_stats_count_what_each_group_alone_could_serve_and_the_turn_end_hits():
    m = _manager()
    turn = list(range(19))
    _turn(m, "a", turn, 18)
    m.end_turn("a", 18)
    m.free("a")
    assert m.allocate("b", turn[:17] + [70, 71, 72])  # attention serves 16 (its full pages), states 16
    assert m.allocate("c", list(range(14)) + [9] * 9)  # attention serves 12, the states only 8
    assert m.allocate("d", turn + [5])  # the turn end: 18 for both
    stats = m.stats()
    assert stats["group_hits"] == [16 + 12 + 18, 16 + 8 + 18] and stats["hits"] == 16 + 8 + 18
    assert stats["turn_end_hits"] == 18 and stats["turn_ends_saved"] == 1


def test_a_prefix_seen_again_saves_a_state_where_it_ends_and_the_next_branch_resumes_there():
    m = _manager()  # states every 8 tokens; attention pages of 4
    shared = list(range(14))
    _turn(m, "a", shared + [90, 91, 92, 93], 17)  # checkpoints at 8 and 16
    m.free("a")
    first = shared[:12] + [70, 71, 72, 73, 74]  # cached attention reaches 12, the states 8
    assert m.allocate("b", first) and m.num_cached_tokens("b") == 8 and m.branch_point("b") == 12
    assert len(m.take_pending_copies()) == 1  # the state at 8 into its running page
    m.cache_blocks("b", 12)  # the scheduler ends a chunk at the branch point
    (_, running, saved), = m.take_pending_copies()
    assert running == m.block_ids("b")[1][0] and m.stats()["branch_states_saved"] == 1
    m.cache_blocks("b", 17)
    m.free("b")
    second = shared[:12] + [60, 61, 62]
    assert m.lookup(second) == 12  # the second branch resumes at the branch state
    assert m.allocate("c", second) and m.branch_point("c") == 0
    assert m.take_pending_copies() == [(1, saved, m.block_ids("c")[1][0])]
    m.check_invariants()


def test_branch_states_are_off_when_the_manager_is_told_so():
    m = KVCacheManager.from_specs([FULL, STATE], 64, block_size=4, cache_on_allocate=False, branch_states=False)
    _turn(m, "a", list(range(18)), 17)
    m.free("a")
    assert m.allocate("b", list(range(12)) + [70, 71, 72]) and m.branch_point("b") == 0
