"""Ragged batching and chunked prefill give exactly the tokens of a plain run (real model).

Runs in `numerics="batch_invariant"`: XLA's float32 CPU matmul is not batch-invariant, so plain
float32 comparisons could flip near-ties (scripts/bench_generate.py measures how often).
"""
from __future__ import annotations

import pytest

from agentjax import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain the theory of relativity in simple terms. Start with the basics of space and time.",
    "Hello",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_eight_prompts_batched_equal_each_alone(smollm2_invariant):
    together = [o.token_ids for o in smollm2_invariant.generate(PROMPTS, GREEDY)]
    alone = [smollm2_invariant.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert len({len(smollm2_invariant.tokenizer.encode(p)) for p in PROMPTS}) >= 6  # lengths differ
    assert together == alone


@pytest.mark.slow
def test_prompt_fed_in_chunks_of_seven_equals_fed_whole(smollm2_invariant):
    from agentjax import LLM

    prompt = PROMPTS[5] + " " + PROMPTS[2]
    whole = smollm2_invariant.generate([prompt], GREEDY)[0].token_ids
    chunked_llm = LLM(numerics="batch_invariant", long_prefill_token_threshold=7)
    chunked = chunked_llm.generate([prompt], GREEDY)[0].token_ids
    assert len(smollm2_invariant.tokenizer.encode(prompt)) > 3 * 7
    assert chunked == whole
