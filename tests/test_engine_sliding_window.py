"""Gemma-3 in the engine: its sliding layers' KV group keeps only the window's pages, tokens unchanged.

The hybrid KV cache gives the sliding layers their own page table, so pages that fall out of the
window go back to the pool. A two-turn conversation of 1.6K tokens, over three times Gemma-3's
512-token window, prefilled in 256-token chunks, must hold at most `window / page + 2` pages of that
group per request after every step, and produce the tokens of a plain run (one chunk per turn,
prefix caching off), in batch-invariant numerics.
"""
from __future__ import annotations

import numpy as np
import pytest

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BLOCK = 16
# Gemma-3 270M's sliding window is 512 tokens (32 pages). Each turn adds 800 prompt tokens: the first
# turn alone overflows the window (its prefill releases pages), the second turn's window group hits
# behind a released prefix, and the conversation ends at ~1.6K tokens, over three windows. The cost
# is the prefill compute (chunked and plain runs both), so the turns are kept this short.
TURN_TOKENS = 800
CHUNK = 256  # < window: a chunk's first queries read the previous chunk's window pages
POOL = 256  # both engines: one plain turn holds the whole conversation in both groups (2 x 101 pages)


@pytest.fixture(scope="module")
def gemma():
    from agentjax.models import load_model

    return load_model("gemma3-270m")


def _turn_prompts(vocab_size: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(7)
    first = [int(t) for t in rng.integers(1000, vocab_size - 1000, TURN_TOKENS)]
    more = [int(t) for t in rng.integers(1000, vocab_size - 1000, TURN_TOKENS)]
    return first, more


def _conversation(engine: Engine, first: list[int], more: list[int], on_step=None) -> tuple[list[list[int]], list[int]]:
    """Two turns; the second prompt is the first prompt, its reply and TURN_TOKENS new tokens.
    Returns the replies and each turn's cached prompt tokens."""
    replies, cached, prompt = [], [], first
    for turn in range(2):
        request_id = engine.add_request(prompt, GREEDY, session_id="s")
        reply, hit = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                reply.extend(out.new_token_ids)
                hit = out.num_cached_tokens
            if on_step is not None:
                on_step(engine)
        replies.append(reply)
        cached.append(hit)
        prompt = prompt + reply + more
        del request_id
    return replies, cached


@pytest.mark.slow
def test_a_gemma3_conversation_over_three_windows_holds_only_the_window_pages_of_its_sliding_group(gemma):
    cfg, params, tokenizer = gemma
    first, more = _turn_prompts(cfg.vocab_size)
    engine = Engine(cfg, params, EngineConfig(numerics="batch_invariant", block_size=BLOCK, num_kv_blocks=POOL,
                                              max_num_batched_tokens=CHUNK), tokenizer)
    sliding = [g.group_id for g in engine.kv.plan.groups if g.spec.hit_rule == "window"]
    full = [g.group_id for g in engine.kv.plan.groups if g.spec.hit_rule == "prefix"]
    assert len(sliding) == 1 and len(full) == 1
    limit = cfg.sliding_window // BLOCK + 2
    held = []

    def check(engine: Engine) -> None:
        for request in engine.scheduler.running:
            tables = engine.kv.block_ids(request.request_id)
            held.append(sum(page != 0 for page in tables[sliding[0]]))
            assert held[-1] <= limit, f"{held[-1]} sliding pages held, at most {limit} allowed"
            assert sum(page != 0 for page in tables[full[0]]) == -(-engine.kv.num_tokens(request.request_id) // BLOCK)

    replies, cached = _conversation(engine, first, more, on_step=check)
    assert cfg.sliding_window == 512 and 2 * TURN_TOKENS > 3 * cfg.sliding_window
    # the second turn hit the first turn's pages in both groups, the window group's released ones aside
    assert cached == [0, (TURN_TOKENS + GREEDY.max_tokens - 1) // BLOCK * BLOCK]
    assert max(held) >= cfg.sliding_window // BLOCK  # the window was full, and no more than it was held

    plain = Engine(cfg, params, EngineConfig(numerics="batch_invariant", block_size=BLOCK, num_kv_blocks=POOL,
                                             max_num_batched_tokens=4096, enable_prefix_caching=False), tokenizer)
    assert replies == _conversation(plain, first, more)[0]
