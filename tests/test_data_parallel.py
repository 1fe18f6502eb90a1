"""agentjax/data_parallel.py: DP/DEP ranks in lockstep on 8 virtual CPU devices. Every tiny preset under
DEP gives the single-device greedy tokens (batch-invariant numerics), requests spread over the ranks,
idle ranks step with dummy rows, and prefill_schedule_interval admits prefills on the same steps on
every rank."""
from __future__ import annotations

import re

import pytest

from agentjax.sampling_params import SamplingParams
from tests.sharding.parity import need_devices
from tests.step_buckets import STEP_BUCKETS

PROMPTS = ([1, 5, 9, 200, 31, 77, 1000, 4, 8, 15, 16, 23, 42, 108, 4815, 1623, 42, 9, 99, 3, 12],
           [7, 7, 7, 300, 12, 64, 901, 33, 5], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [100, 200, 300],
           [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888])
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def _tokens(preset: str, **settings) -> list[list[int]]:
    from agentjax import LLM

    llm = LLM(f"preset:{preset}", numerics="batch_invariant", num_kv_blocks=64, step_buckets=STEP_BUCKETS,
              **settings)
    outs = llm.generate([list(p) for p in PROMPTS], GREEDY)
    return [o.token_ids for o in outs], llm


@pytest.mark.slow
@pytest.mark.parametrize("preset, ranks", [("tiny-dense", 8), ("tiny-sliding", 4), ("tiny-minimax-m3", 8),
                                           ("tiny-kimi-k3", 4), ("tiny-dsv4", 8)])
def test_dep_gives_the_single_device_tokens(preset, ranks):
    need_devices()
    single, _ = _tokens(preset)
    tokens, llm = _tokens(preset, data_parallel_size=ranks, enable_expert_parallel=True)
    assert tokens == single
    busy = [rank for rank, log in enumerate(llm.engine.step_logs) if any(record.rows for record in log)]
    assert len(busy) == min(ranks, len(PROMPTS))  # the requests were spread over the ranks


@pytest.mark.slow
def test_dep_prefills_land_only_on_aligned_steps_on_every_rank():
    need_devices()
    from agentjax import LLM

    llm = LLM("preset:tiny-kimi-k3", numerics="batch_invariant", num_kv_blocks=64, data_parallel_size=4,
              enable_expert_parallel=True, prefill_schedule_interval=4, step_buckets=STEP_BUCKETS)
    engine = llm.engine
    sampling = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    added_at = []
    for step in range(14):  # new requests arrive on aligned and unaligned steps
        if step in (0, 1, 2, 5, 6, 9, 11):
            prompt = list(PROMPTS[step % len(PROMPTS)])
            engine.add_request(prompt, sampling, f"r{step}")
            added_at.append(step)
        engine.step()
    for _ in engine.run_until_done():
        pass
    prefill_steps = set()
    for rank, log in enumerate(engine.step_logs):
        for record in log:
            if any(is_prefill for _, _, is_prefill in record.rows):
                assert record.step_index % 4 == 0, (rank, record)
                prefill_steps.add((rank, record.step_index))
    assert len({rank for rank, _ in prefill_steps}) == 4  # every rank prefilled something
    assert len({index for _, index in prefill_steps}) >= 2  # on more than one aligned step
    assert len({engine.scheduler.step_index for engine in engine.ranks}) == 1  # the ranks stepped together
    assert all(index % 4 for index in added_at[1:3])  # some arrived between aligned steps and waited


def _mixed_run(preset: str, **layout) -> list[tuple]:
    """Greedy runs of PROMPTS where the requests ask for different extras: penalties and a logit bias,
    a regex, log probabilities, prompt log probabilities, nothing; per request its tokens, log
    probability entries and prompt log probability entries."""
    from agentjax import LLM
    from agentjax.structured.spec import StructuredOutput

    plain = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    sampling = [SamplingParams(**plain, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3,
                               logit_bias={7: 2.5, 11: -1.0}),
                SamplingParams(**plain, structured=StructuredOutput.regex("[0-9]{2}-[a-z]{3}")),
                SamplingParams(**plain, logprobs=3),
                SamplingParams(**plain),
                SamplingParams(**plain, prompt_logprobs=2, logprobs=1)]
    llm = LLM(f"preset:{preset}", numerics="batch_invariant", num_kv_blocks=64, step_buckets=STEP_BUCKETS,
              **layout)
    outs = llm.generate([list(p) for p in PROMPTS], sampling)

    def entries(items):
        return None if items is None else [None if e is None else (e.token_id, e.logprob, e.rank, e.top_token_ids,
                                                                   e.top_logprobs) for e in items]

    return [(o.token_ids, o.text, entries(o.logprobs), entries(o.prompt_logprobs)) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout", [
    ("tiny-minimax-m3", dict(data_parallel_size=4, enable_expert_parallel=True)),
    ("tiny-dense", dict(data_parallel_size=2)),
])
def test_dp_runs_structured_output_logprobs_and_penalties_token_exact(preset, layout):
    """Each rank's rows ask for different extras (or none) in the same lockstep steps; every request gets
    the single-device tokens and bit-equal log probabilities."""
    need_devices()
    single = _mixed_run(preset)
    parallel = _mixed_run(preset, **layout)
    assert parallel == single
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", single[1][1])  # the regex held
    assert len(single[2][2]) == 6 and len(single[2][2][0][3]) == 3  # 3 top log probabilities per token
    assert single[4][3][0] is None and len(single[4][3]) == len(PROMPTS[4])
