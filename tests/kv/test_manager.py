"""Tests of agentjax/kv/manager.py: the single-group API of DESIGN.md section 3 and the hybrid cases."""
import subprocess
import sys

import pytest

from agentjax.config import ModelConfig
from agentjax.errors import InvalidRequestError
from agentjax.kv import (BlockRemoved, BlockStored, FullAttentionSpec, KVCacheManager, RecurrentStateSpec,
                         SlidingWindowSpec, block_hashes)

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)  # 32 bytes per token
SLIDING = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=8)
STATE = RecurrentStateSpec(bytes_per_state=128, checkpoint_interval=8)  # one 4-token attention page


def _hybrid(num_blocks=64, **options):
    return KVCacheManager.from_specs([FULL, SLIDING, STATE], num_blocks, block_size=4,
                                     cache_on_allocate=False, **options)


def test_importing_the_manager_pulls_in_no_jax():
    code = "import sys, agentjax.kv; from agentjax.kv import KVCacheManager; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_group_api_reuses_a_cached_prefix_after_free():
    m = KVCacheManager.full_attention(num_blocks=100, block_size=16)
    prompt = list(range(1000, 1100))
    assert m.lookup(prompt) == 0
    assert m.allocate("a", prompt)
    first_pages = m.block_ids("a")[0]
    assert len(first_pages) == 7 and 0 not in first_pages
    assert m.append("a", [7] * 20) is True
    m.free("a")
    longer = prompt + list(range(5000, 5040))
    assert m.lookup(longer) == 96
    assert m.allocate("b", longer) and m.num_cached_tokens("b") == 96
    assert m.block_ids("b")[0][:6] == first_pages[:6]
    stats = m.stats()
    assert stats["queries"] == 240 and stats["hits"] == 96
    assert {"free_blocks", "cached_blocks", "hits", "queries", "evictions"} <= stats.keys()


def test_the_last_token_is_recomputed_without_throwing_away_its_cached_page():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4)
    prompt = list(range(16))
    m.allocate("a", prompt)
    pages = m.block_ids("a")[0]
    m.free("a")
    assert m.lookup(prompt) == 15
    m.allocate("b", prompt)
    assert m.block_ids("b")[0] == pages and m.num_cached_tokens("b") == 15


def test_eviction_takes_the_tail_first_and_the_least_recently_freed_request_first():
    m = KVCacheManager.full_attention(num_blocks=9, block_size=4)  # 8 usable pages
    a, b = list(range(100, 116)), list(range(200, 216))
    m.allocate("a", a), m.allocate("b", b)
    m.cache_blocks("a", 16), m.cache_blocks("b", 16)  # computed: committed, so free keeps them cached
    m.free("a"), m.free("b")
    m.allocate("c", list(range(300, 308)))  # two fresh pages: a's last two blocks go
    assert m.lookup(a + [1]) == 8
    assert m.lookup(b + [1]) == 16
    assert m.stats()["evictions"] == 2


def test_a_prompt_looked_up_again_after_the_pool_changed_finds_its_new_hit_without_hashing_again():
    m = KVCacheManager.full_attention(num_blocks=16, block_size=4)
    prompt = list(range(100, 117))  # 4 full blocks and a token
    assert m.allocate("a", prompt)
    m.block_ids("a")
    m.free("a")
    assert m.lookup(prompt) == 16
    hashing = lambda: (m.stats()["blocks_hashed"], m.stats()["blocks_hash_reused"])  # noqa: E731
    before = hashing()
    third = m.pool.cached_page(0, m.prepare(prompt, None)[1][2])
    assert m.pool.evict(third)  # the pool changed: the hit must be found again
    assert m.lookup(prompt) == 8 and m.lookup(list(prompt)) == 8
    assert hashing() == before  # the same tokens: their hashes are not looked for again
    changed = prompt[:14] + [5] + prompt[15:]  # another fourth block: hashed, the first three reused
    assert m.lookup(changed) == 8 and hashing() == (before[0] + 1, before[1] + 3)


def test_allocate_and_append_refuse_without_side_effects_when_pages_run_out():
    m = KVCacheManager.full_attention(num_blocks=5, block_size=4)
    assert not m.can_allocate(list(range(20)))
    assert m.allocate("x", list(range(20))) is False
    assert m.allocate("a", list(range(16)))
    before = (m.block_ids("a"), m.stats()["free_blocks"])
    assert m.append("a", [1, 2, 3, 4, 5]) is False
    assert (m.block_ids("a"), m.stats()["free_blocks"]) == before and m.num_tokens("a") == 16
    with pytest.raises(InvalidRequestError, match="'a' already holds pages"):
        m.allocate("a", [1])
    with pytest.raises(InvalidRequestError, match="unknown request 'zz'"):
        m.free("zz")


def test_without_caching_nothing_is_hit():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4, enable_caching=False)
    m.allocate("a", list(range(16)))
    m.free("a")
    assert m.lookup(list(range(16))) == 0 and m.stats()["cached_blocks"] == 0


def test_pages_become_hittable_only_after_cache_blocks_in_deferred_mode():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4, cache_on_allocate=False)
    prompt = list(range(13))
    m.allocate("a", prompt)
    assert m.lookup(prompt) == 0
    m.cache_blocks("a", 8)
    assert m.lookup(prompt) == 8
    with pytest.raises(InvalidRequestError, match="num_computed_tokens=14"):
        m.cache_blocks("a", 14)


def test_salted_prompts_do_not_share_pages():
    m = KVCacheManager.full_attention(num_blocks=20, block_size=4)
    m.allocate("a", list(range(9)), cache_salt="tenant-a")
    assert m.lookup(list(range(9)), cache_salt="tenant-a") == 8
    assert m.lookup(list(range(9)), cache_salt="tenant-b") == 0
    assert m.lookup(list(range(9))) == 0


def test_events_stream_stores_and_removals_with_the_router_hashes():
    m = KVCacheManager.full_attention(num_blocks=4, block_size=4, enable_kv_events=True)
    m.allocate("a", list(range(9)))
    m.free("a")
    m.allocate("b", list(range(50, 59)))
    events = m.take_events()
    hashes = block_hashes(list(range(9)), 4)
    assert events[:2] == [BlockStored(hashes[0], None, (0, 1, 2, 3), 0),
                          BlockStored(hashes[1], hashes[0], (4, 5, 6, 7), 0)]
    assert {e.block_hash for e in events if isinstance(e, BlockRemoved)} == set(hashes)


def _run_hybrid_prefill(m, req_id, prompt, boundaries):
    assert m.allocate(req_id, prompt)
    for computed in boundaries:
        m.cache_blocks(req_id, computed)


def test_hybrid_hit_is_the_fixed_point_of_full_sliding_and_state_groups():
    m = _hybrid()
    prompt = list(range(21))
    _run_hybrid_prefill(m, "a", prompt, [8, 16, 20])
    m.free("a")
    # full attention could serve 20 tokens; the state has checkpoints at 8 and 16 only
    assert m.lookup(prompt + [99]) == 16
    sliding_group = 1
    page_3 = m.pool.cached_page(sliding_group, m.groups[1].page_keys(block_hashes(prompt, 4))[3])
    m.pool.evict(page_3)  # the window of a hit at 16 needs sliding pages 2 and 3
    assert m.lookup(prompt + [99]) == 8
    m.check_invariants()


def test_sliding_group_keeps_only_pages_inside_its_window():
    m = _hybrid()
    prompt = list(range(40))
    _run_hybrid_prefill(m, "a", prompt, [40])
    full, sliding, state = m.block_ids("a")
    assert len(full) == 10 and 0 not in full
    assert sliding[:8] == [0] * 8 and 0 not in sliding[8:]  # tokens 33..39 live in pages 8 and 9
    assert len(state) == 1
    m.check_invariants()


def test_a_state_hit_restores_the_checkpoint_by_a_page_copy():
    m = _hybrid()
    prompt = list(range(17))
    _run_hybrid_prefill(m, "a", prompt, [8, 16])
    saves = m.take_pending_copies()
    running_a = m.block_ids("a")[2][0]
    assert [(g, src) for g, src, _ in saves] == [(2, running_a), (2, running_a)]
    m.free("a")
    assert m.allocate("b", prompt) and m.num_cached_tokens("b") == 16
    (group, src, dst), = m.take_pending_copies()
    assert (group, src, dst) == (2, saves[1][2], m.block_ids("b")[2][0])
    m.check_invariants()


def test_page_size_unification_pads_a_state_of_3_1_attention_pages():
    state = RecurrentStateSpec(bytes_per_state=1588, checkpoint_interval=64)  # 3.1 x 512 bytes
    sliding = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=32)
    m = KVCacheManager.from_specs([FULL, sliding, sliding, state], 50, block_size=16)
    plan = m.plan
    assert plan.page_bytes == 4 * 512
    assert [g.tokens_per_page for g in plan.groups] == [64, 32, 64]
    assert [plan.padding_bytes_per_page(g.group_id) for g in plan.groups] == [0, 0, 2048 - 1588]


def test_from_model_config_groups_full_and_sliding_layers():
    cfg = ModelConfig(architecture="gemma3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=256, sliding_window=8,
                      layer_types=("sliding_attention", "sliding_attention", "sliding_attention", "full_attention"))
    m = KVCacheManager.from_model_config(cfg, num_blocks=64, block_size=4)
    assert [g.layer_indices for g in m.plan.groups] == [(0, 1, 2), (3,)]
    assert [g.tokens_per_page for g in m.plan.groups] == [4, 4]
    assert m.allocate("a", list(range(30)))
    sliding, full = m.block_ids("a")
    assert len(full) == 8 and len(sliding) == 8
    m.cache_blocks("a", 30)
    assert m.block_ids("a")[0][:5] == [0] * 5
    assert m.lookup(list(range(31))) == 28


def test_block_ids_hands_out_the_tables_and_never_edits_a_list_it_handed_out():
    m = KVCacheManager.full_attention(num_blocks=32, block_size=4)
    assert m.allocate("a", list(range(100, 108)))  # 2 pages
    first = m.block_ids("a")
    assert m.block_ids("a")[0] is first[0]  # a table that did not change: no copy
    kept = [list(table) for table in first]
    assert m.append("a", [1])  # a third page
    assert first == kept and m.block_ids("a")[0][:2] == kept[0] and len(m.block_ids("a")[0]) == 3
    assert m.reserve("a", 9, num_lookahead_tokens=8)  # pages for 8 draft positions after the 9 tokens
    ahead = m.block_ids("a")
    kept = [list(table) for table in ahead]
    assert len(ahead[0]) == 5 and m.release_lookahead("a") == 2
    assert ahead == kept and m.block_ids("a")[0] == kept[0][:3]
    m.check_invariants()


def test_a_sliding_window_drop_leaves_the_handed_out_table_as_it_was():
    m = _hybrid()
    assert m.allocate("a", list(range(40)))
    m.cache_blocks("a", 16)
    before = m.block_ids("a")
    kept = [list(table) for table in before]
    m.cache_blocks("a", 40)  # the window slides: pages before it become the null page in the table
    assert before == kept
    assert m.block_ids("a")[1][:8] == [0] * 8 and kept[1][:8] != [0] * 8
    m.check_invariants()
