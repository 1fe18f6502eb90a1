"""The engine on the pool of bytes (agentjax/kv/layout.py, agentjax/kv_buffers.py): exact tokens while page
groups trade memory under pressure, per-group bytes in the stats, and a prompt of 0.85 of the memory.

Greedy runs in `numerics="batch_invariant"` on tiny presets (random weights).
"""
from __future__ import annotations

import pytest

from agentjax import LLM, SamplingParams
from agentjax.errors import OutOfPagesError

from tests.step_buckets import pinned_buckets

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _prompts(count: int, length: int, salt: int) -> list[list[int]]:
    return [[(salt * 131 + i * 37 + j * 11) % 500 + 3 for j in range(length + 23 * i)] for i in range(count)]


def _serve(llm: LLM, rounds: list[list[list[int]]], sampling: SamplingParams = GREEDY) -> list[list[list[int]]]:
    """Each round's prompts submitted together; the tokens of every request, round by round."""
    engine, out = llm.engine, []
    for prompts in rounds:
        ids = [engine.add_request(p, sampling) for p in prompts]
        tokens = {i: [] for i in ids}
        for output in engine.run_until_done():
            tokens[output.request_id].extend(output.new_token_ids)
        out.append([tokens[i] for i in ids])
    return out


@pytest.mark.slow
def test_groups_trade_memory_under_pressure_and_the_tokens_stay_those_of_a_large_pool():
    """Kimi-style: states saved every 64 tokens and latent pages compete for a 256 KiB pool; slabs go from
    one page group to the other and a request is preempted, yet every token equals a roomy pool's."""
    rounds = [_prompts(6, 300, 1), _prompts(6, 300, 2)]
    settings = dict(numerics="batch_invariant", max_num_batched_tokens=64, step_buckets=pinned_buckets(64))
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM("preset:tiny-kimi-k3", kv_cache_memory_gb=0.05, **settings)
    expected = _serve(roomy, rounds, sampling)
    tight = LLM("preset:tiny-kimi-k3", kv_cache_memory_gb=256 / 2**20, **settings)  # 6 slabs of 37.5 KiB
    assert tight.engine.kv.layout.mode == "pool" and tight.engine.kv.layout.num_slabs == 6
    assert _serve(tight, rounds, sampling) == expected
    assert tight.engine.kv.pool.slab_trades > 0 and tight.engine.scheduler.num_preemptions > 0
    assert roomy.engine.scheduler.num_preemptions == 0


@pytest.mark.slow
def test_stats_report_each_page_groups_used_and_reserved_bytes():
    llm = LLM("preset:tiny-sliding", numerics="batch_invariant", kv_cache_memory_gb=0.001,
              max_num_batched_tokens=64, step_buckets=pinned_buckets(64))
    _serve(llm, [_prompts(2, 90, 3)])
    groups = {row["group"]: row for row in llm.engine.stats()["kv_groups"]}
    assert set(groups) == {"kv.0", "kv.1"}  # the sliding kind, the full kind
    layout = llm.engine.kv.layout
    for row in groups.values():
        assert row["used_bytes"] == (row["held_pages"] + row["cached_pages"]) * row["page_bytes"] > 0
        assert row["used_bytes"] <= row["reserved_bytes"] and row["reserved_bytes"] % layout.slab_bytes == 0
    assert sum(row["reserved_bytes"] for row in groups.values()) <= layout.total_bytes


@pytest.mark.slow
def test_a_prompt_storing_0_85_of_the_memory_is_admitted_and_runs_where_shared_ids_refuse_it():
    """Two sliding layers and one full layer: 128 B per token for good, 256 B per token of the window.
    A prompt storing 0.85 of 512 KiB runs on the pool; the shared layout reserves every layer per page."""
    # chunks of 256 tokens up to a context of about 210 pages: one step shape
    memory_gb, settings = 1 / 2048, dict(numerics="batch_invariant", max_num_batched_tokens=256,
                                         step_buckets=pinned_buckets(256, pages=256))
    prompt = [(7 * j) % 400 + 5 for j in range(int(0.85 * 2**19 - 2 * 8 * 128) // 128)]
    llm = LLM("preset:tiny-sliding", kv_cache_memory_gb=memory_gb, **settings)
    (tokens,) = _serve(llm, [[prompt]])[0]
    assert len(tokens) == GREEDY.max_tokens
    shared = LLM("preset:tiny-sliding", kv_cache_memory_gb=memory_gb, kv_layout="shared", **settings)
    with pytest.raises(OutOfPagesError):
        shared.engine.add_request(prompt, GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize("preset, hits", [("preset:tiny-kimi-k3", [0, 0, 96]), ("preset:tiny-sliding", [0, 96, 96])])
def test_default_pages_stay_small_and_a_100_token_shared_prefix_hits(preset, hits):
    """With the default settings every attention page group of Kimi-style and Gemma-style models keeps
    pages of at most 64 tokens, so prompts that share only a 100-token prefix (a system prompt sent
    first) share the cache: six 16-token pages of full and sliding attention. Kimi's KDA states are
    saved every 112 tokens by default (cost-aware: a float32 state weighs 100 tokens of latent), so the
    first prompt that continues the prefix recomputes it and saves the state where the cached pages end
    (a branch state); the next resumes there."""
    llm = LLM(preset, numerics="batch_invariant", step_buckets=pinned_buckets(256))  # buckets: no page setting
    layout = llm.engine.kv.layout
    assert layout.mode == "pool" and max(g.tokens_per_page for g in layout.groups if g.hit_rule != "checkpoint") <= 64
    shared = [(13 * j) % 400 + 5 for j in range(100)]
    outputs = [llm.generate([prompt], GREEDY)[0] for prompt in (shared, shared + [7, 8, 9] * 10,
                                                                 shared + [11, 12] * 20)]
    assert [out.num_cached_tokens for out in outputs] == hits
