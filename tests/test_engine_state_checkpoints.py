"""Prefix hits for recurrent-state models: a prompt that shares k tokens with a cached one resumes
from the last saved state at or before min(k, len - 1) (interval checkpoints and the state a turn ended
with), reports exactly those tokens cached, and gives the tokens of a cold run (numerics="batch_invariant"). On tiny-kimi-k3 and on the Kimi-Linear HF
checkpoint fixture (tests/models/data/kimi-linear-a), states every 64 tokens, chunks of 128 tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

from tests.step_buckets import STEP_BUCKETS

DATA = Path(__file__).parent / "models" / "data"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MODELS = {"tiny-kimi-k3": "preset:tiny-kimi-k3", "kimi-linear-a": str(DATA / "kimi-linear-a")}


def _engine(llm: LLM, **settings) -> Engine:
    base = dict(numerics="batch_invariant", num_kv_blocks=128, max_num_batched_tokens=128,
                state_checkpoint_tokens=64, step_buckets=STEP_BUCKETS)  # 128-token chunks: one step shape
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), None)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(prompt, GREEDY)
    tokens, cached = [], None
    for out in engine.run_until_done():
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module", params=sorted(MODELS))
def llm(request):
    return LLM(model=MODELS[request.param], numerics="batch_invariant", num_kv_blocks=64)


@pytest.mark.slow
def test_interval_states_are_hit_and_tokens_equal_a_cold_run(llm):
    vocab = min(llm.model_config.vocab_size, 512)
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(0, vocab, 320)]
    others = [int(t) for t in rng.integers(0, vocab, 50)]
    engine = _engine(llm)
    reply, cached = _run(engine, base)
    assert cached == 0
    rows = [  # (prompt, tokens cached): issue 37's table
        (base, 256),  # the same prompt: the last saved state before its last token
        (base[:300], 256),  # a prefix of it
        (base + [7], 320),  # one token more: the state at its end
        (base + reply + others[:40], 323),  # the next turn: the state after the last token the model consumed
        (base[:200] + others, 192),  # a branch: the interval state inside the first run's second chunk
    ]
    cold = _engine(llm, enable_prefix_caching=False)
    for prompt, expected in rows:
        tokens, cached = _run(engine, prompt)
        assert cached == expected, (len(prompt), cached)
        assert tokens == _run(cold, prompt)[0], len(prompt)
    engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_a_second_branch_resumes_where_the_first_found_the_prefix_cached(llm):
    """The default (cost-aware) interval, hint policy: subagents that share a parent's first 200 tokens.
    The first branch resumes at the last interval state and saves a state where the cached attention
    pages end (192: the Marconi rule on the device); the second resumes there."""
    vocab = min(llm.model_config.vocab_size, 512)
    rng = np.random.default_rng(1)
    parent = [int(t) for t in rng.integers(0, vocab, 320)]
    engine = _engine(llm, state_checkpoint_tokens=None)
    interval = engine.kv.layout.state_interval()
    assert interval == {512: 208}.get(llm.model_config.vocab_size, 112)  # kimi-linear-a, tiny-kimi-k3
    _run(engine, parent)
    cold = _engine(llm, enable_prefix_caching=False)
    for branch, expected in ((1, 192 // interval * interval), (2, 192)):
        prompt = parent[:200] + [int(t) for t in rng.integers(0, vocab, 30)]
        tokens, cached = _run(engine, prompt)
        assert cached == expected, (branch, cached)
        assert tokens == _run(cold, prompt)[0]
    assert engine.kv.stats()["branch_states_saved"] == 1
