"""Tests of agentjax/kv/state_saves.py through the manager: the pages for the recurrent states at the
checkpoints inside a chunk, cached once the chunk ran, given back when it did not."""
from agentjax.kv import FullAttentionSpec, KVCacheManager, RecurrentStateSpec

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)
STATE = RecurrentStateSpec(bytes_per_state=128, checkpoint_interval=8)  # a state every two 4-token pages


def _manager(num_blocks=64):
    return KVCacheManager.from_specs([FULL, STATE], num_blocks, block_size=4, cache_on_allocate=False)


def test_a_chunk_saves_the_states_inside_it_and_a_later_prompt_hits_each_of_them():
    m = _manager()
    prompt = list(range(30))
    assert m.allocate("a", prompt)
    assert m.reserve_state_saves("a", 0, 30) == 3  # states at 8, 16 and 24
    running, *saves = m.block_ids("a")[1]
    assert len(saves) == 3 and len(set(saves)) == 3 and running not in saves
    m.cache_blocks("a", 30)
    assert m.block_ids("a")[1] == [running]
    m.free("a")
    for shared, expected in ((9, 8), (20, 16), (29, 24)):
        assert m.lookup(prompt[:shared] + [99, 98]) == expected
    m.check_invariants()


def test_checkpoints_already_cached_take_no_page_and_the_order_of_columns_holds():
    m = _manager()
    prompt = list(range(30))
    assert m.allocate("a", prompt)
    m.reserve_state_saves("a", 0, 12)  # the state at 8
    m.cache_blocks("a", 12)
    m.free("a")
    assert m.allocate("b", prompt) and m.num_cached_tokens("b") == 8
    assert m.reserve_state_saves("b", 8, 30) == 2  # 16 and 24; 8 is cached and not inside the chunk
    assert len(m.block_ids("b")[1]) == 3
    assert m.reserve_state_saves("b", 8, 30) == 0  # already reserved
    m.check_invariants()


def test_pages_of_a_chunk_that_never_ran_go_back_when_the_request_is_freed():
    m = _manager(num_blocks=32)
    free_before = m.num_free_blocks
    assert m.allocate("a", list(range(30)))
    m.reserve_state_saves("a", 0, 30)
    m.free("a")  # preempted or aborted before the step: nothing cached, every page free again
    assert m.num_free_blocks == free_before and m.lookup(list(range(30))) == 0
    m.check_invariants()


def test_a_full_pool_skips_the_checkpoints_it_has_no_page_for():
    m = _manager(num_blocks=11)  # 8 attention pages and the running state take 9 of its 10 pages
    prompt = list(range(30))
    assert m.allocate("a", prompt)
    assert m.reserve_state_saves("a", 0, 30) == 1  # one page left: the state at 8, the others skipped
    m.cache_blocks("a", 30)
    m.free("a")
    assert m.lookup(prompt[:20] + [99]) == 8
    m.check_invariants()
