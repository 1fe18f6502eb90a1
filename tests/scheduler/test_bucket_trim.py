"""A step whose tokens overflow a shape bucket by less than the padding to the next one is trimmed to the
bucket below: its last prefill chunks wait a step. Scheduling without a model, then the real model's
tokens in batch-invariant numerics, trimmed and not."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.kv import KVCacheManager
from agentjax.kv.specs import FullAttentionSpec
from agentjax.sampling_params import SamplingParams
from agentjax.scheduler.request import Request
from agentjax.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _first_steps(lengths: list[int], steps: int = 2, **settings) -> list[list[int]]:
    """Each step's row token counts for prompts of `lengths` submitted together."""
    kv = KVCacheManager.from_specs([FullAttentionSpec()], 256, 16, cache_on_allocate=False)
    scheduler = Scheduler(EngineConfig(max_num_batched_tokens=2048, **settings), kv)
    for i, length in enumerate(lengths):
        scheduler.add(Request(f"r{i}", [5 + i] * length, GREEDY, frozenset(), arrival_index=i))
    counts = []
    for _ in range(steps):
        plan = scheduler.schedule()
        counts.append([item.num_new_tokens for item in plan.scheduled])
        scheduler.update_from_output(plan, [7] * len(plan.scheduled))
    return counts


def test_a_step_just_past_a_bucket_leaves_its_overflow_to_the_next_step():
    # 300 tokens: 44 past 256, 212 short of 512, so the last row's chunk waits for its last 44 tokens.
    assert _first_steps([100, 100, 100]) == [[100, 100, 56], [1, 1, 44]]
    # Several rows give up tokens, each keeping one, latest first: 674 tokens are 162 past 512.
    first, second = _first_steps([42] * 15 + [44])
    assert sum(first) == 512 and first[:12] == [42] * 12 and first[12:] == [5, 1, 1, 1]
    assert second == [1] * 12 + [37, 41, 41, 43]
    # Switched off, the step carries every token (and pads to 512, or 1024).
    assert _first_steps([100, 100, 100], trim_prefill_to_buckets=False) == [[100, 100, 100], [1, 1, 1]]


@pytest.mark.parametrize("lengths", [[130, 130, 130], [100, 100], [40, 40]], ids=["upper-half", "below-256", "small"])
def test_a_step_in_the_upper_half_of_a_bucket_or_below_256_tokens_is_not_trimmed(lengths):
    # 390 tokens are 134 past 256 but only 122 short of 512; 200 and 80 tokens lie below the smallest
    # bucket that is trimmed to (256).
    assert _first_steps(lengths, steps=1) == [lengths]


@pytest.mark.slow
def test_trimmed_steps_give_the_untrimmed_runs_tokens(smollm2_invariant):
    """Batch-invariant numerics: three prompts of 110 tokens (330 in the first step, trimmed to 256) give
    the tokens of the same batch with trimming off."""
    from agentjax import LLM

    untrimmed = LLM(numerics="batch_invariant", max_num_batched_tokens=512, trim_prefill_to_buckets=False)
    prompts = [[1] + [100 + 7 * i + j for j in range(109)] for i in range(3)]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    scheduler = smollm2_invariant.engine.scheduler
    step_tokens = []
    schedule = scheduler.schedule

    def recording_schedule():
        plan = schedule()
        step_tokens.append(plan.num_tokens)
        return plan

    scheduler.schedule = recording_schedule
    try:
        trimmed = [out.token_ids for out in smollm2_invariant.generate(prompts, sampling)]
    finally:
        del scheduler.schedule
    assert step_tokens[:2] == [256, 74 + 2]  # the trim happened: 330 tokens would have padded to 512
    assert trimmed == [out.token_ids for out in untrimmed.generate(prompts, sampling)]
