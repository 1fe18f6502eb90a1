"""Parallel samples (`n`, `best_of`) through `LLM` and the engine, on the tiny random preset: each sample
draws from its own seed stream, and the prompt's pages are computed once for all of them."""
from __future__ import annotations

import pytest

from agentjax import LLM, SamplingParams
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import sample_seed

PROMPT = list(range(100, 137))  # 37 tokens: two whole pages of 16 and a tail of 5


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="preset:tiny-dense", num_kv_blocks=128)


def fresh_engine(llm: LLM, **settings) -> Engine:
    return Engine(llm.model_config, llm.params, EngineConfig(**{"num_kv_blocks": 128, **settings}), llm.tokenizer)


@pytest.mark.slow
def test_n_3_with_a_seed_gives_three_different_replies_reproducible_across_runs(tiny):
    sampling = SamplingParams(n=3, seed=1234, max_tokens=8, temperature=1.0, ignore_eos=True)
    first = tiny.generate([PROMPT], sampling)[0]
    again = tiny.generate([PROMPT], sampling)[0]
    other = LLM(model="preset:tiny-dense", num_kv_blocks=64).generate([PROMPT], sampling)[0]
    replies = [o.token_ids for o in first.outputs]
    assert len(replies) == 3 and len({tuple(r) for r in replies}) == 3
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert replies == [o.token_ids for o in again.outputs] == [o.token_ids for o in other.outputs]
    assert first.token_ids == replies[0]
    single = tiny.generate([PROMPT], SamplingParams(seed=1234, max_tokens=8, temperature=1.0, ignore_eos=True))[0]
    assert single.token_ids == replies[0]  # sample 0 keeps the request's seed


def test_each_sample_draws_from_its_own_derived_seed():
    seeds = [sample_seed(7, i) for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and seeds == [sample_seed(7, i) for i in range(4)]
    assert sample_seed(None, 3) is None


def test_the_prompt_is_computed_once_for_three_samples(tiny):
    engine = fresh_engine(tiny)
    sampling = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    first = engine.add_request(PROMPT, sampling.for_sample(0))
    forks = [engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=i),
                                fork_of=first) for i in (1, 2)]
    outputs = list(engine.run_until_done())
    stats = engine.stats()
    assert stats["prompt_tokens_total"] == len(PROMPT)  # counted once
    # the first sample runs all 37 prompt tokens; each fork reads the two whole pages (32 tokens) from
    # the cache and runs only the 5-token tail of the last, partly filled page
    assert stats["prompt_tokens_computed_total"] == len(PROMPT) + 2 * 5
    cached = {o.request_id: o.num_cached_tokens for o in outputs}
    assert cached[first] == 0 and [cached[f] for f in forks] == [32, 32]
    assert sum(len(o.new_token_ids) for o in outputs) == 12


def test_forks_wait_for_the_first_sample_and_run_even_if_it_ends_at_its_first_token(tiny):
    engine = fresh_engine(tiny)
    first = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
    fork = engine.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                              fork_of=first)
    steps = []
    while engine.has_unfinished():
        steps.append({o.request_id for o in engine.step()})
    assert steps[0] == {first}  # the fork was not scheduled beside the first sample's prefill
    assert sum(fork in s for s in steps) == 3


def test_aborting_a_waiting_fork_or_its_first_sample_leaves_nothing_behind(tiny):
    engine = fresh_engine(tiny)
    first = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    waiting = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), fork_of=first)
    released = engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), fork_of=first)
    engine.abort(waiting)
    engine.abort(first)  # its remaining fork runs on its own (computing the prompt itself)
    ids = {o.request_id for o in engine.run_until_done()}
    assert ids == {released} and not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_pages - 1


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(tiny):
    all_four = tiny.generate([PROMPT], SamplingParams(n=4, seed=5, max_tokens=6, ignore_eos=True, logprobs=0))[0]
    best = tiny.generate([PROMPT], SamplingParams(n=2, best_of=4, seed=5, max_tokens=6, ignore_eos=True))[0]
    ranked = sorted(all_four.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked]
    assert [o.index for o in best.outputs] == [0, 1]
    assert all(o.logprobs is None and o.cumulative_logprob is not None for o in best.outputs)
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_samples_of_a_prompt_logprobs_request_read_the_first_samples_pages_and_report_the_prompt_once(tiny):
    out = tiny.generate([PROMPT], SamplingParams(n=2, seed=3, max_tokens=3, prompt_logprobs=1, logprobs=1))[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert all(e is not None for e in out.prompt_logprobs[1:])
    assert [len(o.logprobs) for o in out.outputs] == [3, 3]
    engine = fresh_engine(tiny)
    first = engine.add_request(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0))
    fork = engine.add_request(PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0, seed=9), fork_of=first)
    outputs = list(engine.run_until_done())
    prompt_reports = {o.request_id: o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None}
    assert set(prompt_reports) == {first}
    assert {o.request_id: o.num_cached_tokens for o in outputs}[fork] == 32
