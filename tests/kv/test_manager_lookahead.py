"""Lookahead pages for speculative decoding: `reserve(..., num_lookahead_tokens)` covers the draft
positions, `release_lookahead` gives back the pages only rejected drafts used, and the prefix cache
only ever holds pages computed from kept tokens."""
from __future__ import annotations

from agentjax.kv import FullAttentionSpec, KVCacheManager, SlidingWindowSpec

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2)
SLIDING = SlidingWindowSpec(num_kv_heads=1, head_dim=8, dtype_bytes=2, sliding_window=8)


def _manager(specs=(FULL,), num_blocks=32):
    return KVCacheManager.from_specs(list(specs), num_blocks, block_size=4, cache_on_allocate=False)


def test_lookahead_pages_cover_the_drafts_in_every_group():
    m = _manager((FULL, SLIDING))
    assert m.allocate("a", list(range(100, 110)))  # 10 tokens: 3 pages per group
    m.cache_blocks("a", 9)
    free_before = m.num_free_blocks
    assert m.reserve("a", 10, num_lookahead_tokens=5)  # positions up to 14: 4 pages per group
    assert [len(t) for t in m.block_ids("a")] == [4, 4]
    assert m.num_free_blocks == free_before - 2
    m.append("a", [1])  # one draft accepted: 11 tokens, the next goes at position 11 (page 2)
    assert m.release_lookahead("a") == 2  # page 3 of each group held only rejected drafts
    assert [len(t) for t in m.block_ids("a")] == [3, 3]
    m.append("a", [2])
    assert m.release_lookahead("a") == 0  # the next position, 12, needs page 3: not reserved yet
    m.check_invariants()


def test_release_lookahead_keeps_the_page_of_the_next_position():
    m = _manager()
    assert m.allocate("a", list(range(100, 108)))  # 2 pages
    m.cache_blocks("a", 7)
    assert m.reserve("a", 8, num_lookahead_tokens=6)  # positions up to 13: 4 pages
    pages = m.block_ids("a")[0]
    assert len(pages) == 4
    free = m.num_free_blocks
    assert m.release_lookahead("a") == 1  # position 8, the next token's, lives in page 2
    assert m.block_ids("a")[0] == pages[:3] and m.num_free_blocks == free + 1
    m.check_invariants()


def test_pages_written_by_rejected_drafts_never_become_hittable():
    m = _manager()
    prompt = list(range(100, 106))
    assert m.allocate("a", prompt)
    assert m.reserve("a", 6, num_lookahead_tokens=4)  # drafts at positions 6..9 fill page 1 and reach page 2
    m.cache_blocks("a", 6)  # none accepted: 6 tokens computed
    m.release_lookahead("a")
    m.free("a")
    # the drafts were never appended, so no hash of them exists: a prompt with them finds only page 0
    assert m.lookup(prompt + [1, 2, 3, 4, 5]) == 4
    m.check_invariants()
