"""Penalties and log probabilities through the engine, on the tiny random preset (fast).

Values are checked against a recomputation of the same tokens with `make_step(all_positions=True)`
(the plain forward, `make_forward`, plus the logits), and penalties against vLLM's formula applied by
hand to the raw logits the engine reports.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from agentjax import LLM, SamplingParams
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.step import make_step

from tests.step_buckets import STEP_BUCKETS

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 11, 12, 13, 14, 30, 31, 32, 33]


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="preset:tiny-dense", num_kv_blocks=128)


def engine_of(llm: LLM, **settings) -> Engine:
    """An engine over the module's weights; one step shape unless `step_buckets` says otherwise."""
    base = {"num_kv_blocks": 128, "step_buckets": STEP_BUCKETS}
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), llm.tokenizer)


def run(engine: Engine, prompt, sampling: SamplingParams):
    request_id = engine.add_request(prompt, sampling)
    tokens, entries, prompt_entries = [], [], None
    for out in engine.run_until_done():
        assert out.request_id == request_id
        tokens += out.new_token_ids
        entries += out.logprobs or []
        prompt_entries = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_entries
    return tokens, entries, prompt_entries


def recomputed_logprobs(llm: LLM, tokens: list[int]) -> np.ndarray:
    """Log-softmax of every position's logits, from one plain forward over the whole sequence."""
    cfg = llm.model_config
    page = llm.engine_config.block_size
    kv = cfg.new_kv_pages(2 + -(-len(tokens) // page), page)
    logits, _ = make_step(cfg, llm.engine_config.numerics, all_positions=True)(
        llm.params, kv, RaggedBatch.from_prompts([tokens], page))
    return np.asarray(jax.nn.log_softmax(np.asarray(logits[:len(tokens)], np.float32), axis=-1))


def test_greedy_logprobs_and_prompt_logprobs_match_a_plain_forward_within_1e_4(tiny):
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    tokens, entries, prompt_entries = run(engine_of(tiny), PROMPT, sampling)
    reference = recomputed_logprobs(tiny, PROMPT + tokens)
    assert len(entries) == len(tokens) == 6
    for step, (token, entry) in enumerate(zip(tokens, entries)):
        row = reference[len(PROMPT) - 1 + step]
        assert entry.token_id == token and entry.rank == 1 and entry.top_token_ids[0] == token
        assert all(v <= 0 for v in entry.top_logprobs) and np.exp(entry.top_logprobs).sum() <= 1 + 1e-6
        assert entry.logprob == pytest.approx(row[token], abs=1e-4)
        assert list(entry.top_token_ids) == np.argsort(-row)[:5].tolist()
        np.testing.assert_allclose(entry.top_logprobs, np.sort(row)[::-1][:5], atol=1e-4)
    assert prompt_entries[0] is None and len(prompt_entries) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry, row = prompt_entries[position], reference[position - 1]
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(row[PROMPT[position]], abs=1e-4)
        assert entry.rank == 1 + int((row > row[PROMPT[position]]).sum())
        assert list(entry.top_token_ids) == np.argsort(-row)[:3].tolist()


def test_prompt_logprobs_are_bitwise_the_same_when_the_prompt_runs_in_chunks_of_7(tiny):
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    whole = run(engine_of(tiny, numerics="batch_invariant"), PROMPT, sampling)
    chunked = run(engine_of(tiny, numerics="batch_invariant", long_prefill_token_threshold=7), PROMPT, sampling)
    assert chunked == whole  # tokens, their entries and the prompt's, every value bit for bit


def test_a_prompt_logprobs_request_reads_no_cached_page(tiny):
    engine = engine_of(tiny)
    run(engine, PROMPT, SamplingParams(max_tokens=1, temperature=0.0))  # leaves the prompt's pages cached
    request_id = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    outputs = list(engine.run_until_done())
    assert outputs[0].request_id == request_id and outputs[0].num_cached_tokens == 0
    assert all(e is not None for e in outputs[0].prompt_logprobs[1:])


@pytest.mark.slow
def test_penalties_on_the_device_follow_vllms_formula_on_the_raw_logits(tiny):
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0, presence_penalty=0.3,
                              frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={12: 2.0, 40: -1.5})
    raw_tokens, raw, _ = run(engine_of(tiny, logprobs_mode="raw_logits"), PROMPT, sampling)
    tokens, processed, _ = run(engine_of(tiny, logprobs_mode="processed_logits"), PROMPT, sampling)
    assert tokens == raw_tokens
    for step, token in enumerate(tokens):
        count = tokens[:step].count(token)
        value = raw[step].logprob + sampling.logit_bias.get(token, 0.0)
        if count or token in PROMPT:
            value = value / 1.3 if value > 0 else value * 1.3
        value -= 0.7 * count + 0.3 * (count > 0)
        assert processed[step].logprob == pytest.approx(value, abs=1e-4)
        assert processed[step].rank == 1  # greedy picks the top of the penalized logits


def test_a_logit_bias_of_minus_100_bans_the_greedy_token(tiny):
    plain, _, _ = run(engine_of(tiny), PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    banned = plain[0]
    biased, _, _ = run(engine_of(tiny), PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                               logit_bias={banned: -100.0}))
    assert banned not in biased and biased != plain


def test_a_frequency_penalty_stops_a_greedy_loop_from_repeating_tokens(tiny):
    plain, _, _ = run(engine_of(tiny), PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(set(plain)) < len(plain)  # the random model repeats itself
    spread, _, _ = run(engine_of(tiny), PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                               frequency_penalty=2.0, presence_penalty=2.0))
    assert len(set(spread)) > len(set(plain))


def test_plain_steps_run_the_plain_step_and_extras_compile_per_bucket_not_per_request(tiny):
    engine = engine_of(tiny, step_buckets=None)  # the default buckets
    run(engine, PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    plain_shapes = set(engine.runner.compiled_shapes)
    assert all(len(key) == 4 for key in plain_shapes)  # (tokens, rows, pages, greedy): no extras
    for k in (1, 4, 20):
        run(engine, PROMPT, SamplingParams(max_tokens=3, temperature=0.0, logprobs=k, logit_bias={k: 1.0}))
    extended = engine.runner.compiled_shapes - plain_shapes
    assert len({key[3:] for key in extended}) == 1  # one variant for every k and every bias
