"""Kimi-Linear (KDA + NoPE MLA + MoE) token for token with transformers 5.24.0, and exact under
batching, chunking, caching and preemption.

The fixtures (tests/models/data/kimi-linear-{a,b}, made by scripts/make_model_fixtures.py) hold
tiny random checkpoints as transformers saves them, with its prompt logits and greedy tokens. They
load through `LLM(model=directory)` with token-id prompts (no tokenizer in the directory). The
exactness runs are greedy in numerics="batch_invariant" (see DESIGN.md section 4).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner import make_step
from agentjax.sampling_params import SamplingParams

from tests.step_buckets import pinned_buckets

DATA = Path(__file__).parent / "data"
FIXTURES = ["kimi-linear-a", "kimi-linear-b"]
MIN_MARGIN = 2e-3  # transformers' top-1 minus top-2 logit below which a differing token is a tie
PAGE = 16


def _reference(name: str):
    return np.load(DATA / name / "reference.npz")


def _tokens_agree(ours: list[int], reference) -> bool:
    """Equal to transformers' greedy tokens (as far as `ours` goes) up to the first step whose margin
    is under MIN_MARGIN: after a near-tie the continuations may rightly differ."""
    for step, (token, expected) in enumerate(zip(ours, reference["generated_ids"])):
        if reference["generated_margins"][step] < MIN_MARGIN:
            return True
        if token != int(expected):
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_prompt_logits_and_greedy_tokens_match_transformers(name):
    reference = _reference(name)
    prompt = [int(t) for t in reference["prompt_ids"]]
    # token-id prompts: the directory has no tokenizer
    llm = LLM(model=str(DATA / name), num_kv_blocks=64, step_buckets=pinned_buckets(128))
    cfg, params = llm.model_config, llm.params
    assert llm.tokenizer is None and cfg.architecture == "kimi_linear"
    step = make_step(cfg, all_positions=True)
    kv = cfg.new_kv_pages(2 + len(prompt) // PAGE + 1, PAGE)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([prompt], PAGE))
    assert np.abs(np.asarray(logits)[: len(prompt)] - reference["prompt_logits"]).max() < 1e-4

    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert out.text == "" and len(out.token_ids) == 24 and _tokens_agree(out.token_ids, reference)


# ---- exactness (numerics="batch_invariant") on kimi-linear-a ----------------------------------------

TURN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NUM_SESSIONS = 8


def _first_prompts() -> list[list[int]]:
    """Session 0 asks transformers' prompt; the others 66..80-token prompts of the same vocabulary."""
    base = [int(t) for t in _reference("kimi-linear-a")["prompt_ids"]]
    rng = np.random.default_rng(7)
    return [base] + [[int(t) for t in rng.integers(0, 512, 66 + 2 * s)] for s in range(1, NUM_SESSIONS)]


def _engine(llm: LLM, **settings) -> Engine:
    base = dict(numerics="batch_invariant", num_kv_blocks=256, max_num_batched_tokens=128,
                step_buckets=pinned_buckets(128))  # every step one shape: the property is the cache/chunk path
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), None)


def _run_sessions(engine: Engine, sessions: list[int]) -> dict:
    """Two turns per session, every session's turn submitted together; the second turn's prompt is
    the first prompt, its reply and 10 new tokens. Returns per session [(prompt, reply, cached)]."""
    prompts = {s: _first_prompts()[s] for s in sessions}
    follow_up = np.random.default_rng(11).integers(0, 512, (NUM_SESSIONS, 10))
    turns = {s: [] for s in sessions}
    for turn in range(2):
        ids = {engine.add_request(prompts[s], TURN, session_id=f"s{s}"): s for s in sessions}
        replies, cached = {rid: [] for rid in ids}, {}
        for out in engine.run_until_done():
            replies[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        for rid, s in ids.items():
            turns[s].append((prompts[s], replies[rid], cached[rid]))
            prompts[s] = prompts[s] + replies[rid] + [int(t) for t in follow_up[s]]
    return turns


def _replies(turns: dict) -> dict:
    return {s: [reply for _, reply, _ in t] for s, t in turns.items()}


@pytest.fixture(scope="module")
def invariant_llm():
    return LLM(model=str(DATA / "kimi-linear-a"), numerics="batch_invariant", num_kv_blocks=256)


@pytest.fixture(scope="module")
def plain_run(invariant_llm):
    """Every session alone, prefix caching off, no chunking: the reference tokens."""
    reference = {}
    for s in range(NUM_SESSIONS):
        reference.update(_replies(_run_sessions(_engine(invariant_llm, enable_prefix_caching=False), [s])))
    return reference


@pytest.mark.slow
def test_plain_run_tokens_are_transformers_tokens(plain_run):
    assert _tokens_agree(plain_run[0][0], _reference("kimi-linear-a"))


@pytest.mark.slow
def test_second_turn_resumes_from_the_state_the_first_turn_ended_with(invariant_llm, plain_run):
    turns = _run_sessions(_engine(invariant_llm), [0])
    assert _replies(turns)[0] == plain_run[0]
    (first_prompt, first_reply, first_cached), (_, _, cached) = turns[0]
    assert first_cached == 0
    # 72 prompt + 5 computed reply tokens are shared: the state the first turn ended with holds all of them
    assert cached == len(first_prompt) + len(first_reply) - 1 == 77


@pytest.mark.slow
def test_prefill_chunks_of_16_give_the_same_tokens(invariant_llm, plain_run):
    engine = _engine(invariant_llm, long_prefill_token_threshold=16)
    turns = _run_sessions(engine, [0, 1])
    assert _replies(turns) == {s: plain_run[s] for s in (0, 1)}
    assert max(n for record in engine.step_log for _, n, prefill in record.rows if prefill) <= 16


@pytest.mark.slow
def test_eight_interleaved_sessions_equal_the_plain_run(invariant_llm, plain_run):
    assert _replies(_run_sessions(_engine(invariant_llm), list(range(NUM_SESSIONS)))) == plain_run


@pytest.mark.slow
def test_preemption_in_a_small_pool_keeps_tokens_exact(invariant_llm, plain_run):
    # The shared layout: 16 page ids hold about two sessions at a time. The byte pool gives these short
    # sessions room enough never to preempt at any size they fit; its preemption under pressure is
    # tests/test_engine_kv_layout.py::test_groups_trade_memory_under_pressure_and_the_tokens_stay_those_of_a_large_pool.
    engine = _engine(invariant_llm, num_kv_blocks=16, kv_layout="shared")
    turns = _run_sessions(engine, list(range(NUM_SESSIONS)))
    assert engine.scheduler.num_preemptions > 0 and any(record.preempted for record in engine.step_log)
    assert _replies(turns) == plain_run
