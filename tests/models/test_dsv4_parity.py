"""DeepSeek-V4 token for token with transformers 5.24.0's cached `generate`, and exact under batching,
chunking, caching and preemption.

The fixtures (tests/models/data/deepseek-v4-{a,b}, made by scripts/make_model_fixtures.py with
scripts/dsv4_fixtures.py) hold tiny random checkpoints as transformers saves them, with the tokens
and logits of its cached `generate` (prefill once, then one token per step) and of its uncached
step-by-step forward. Where transformers' two paths part: only where a CSA layer's lightning indexer
meets tied scores at its top-k boundary (several compressed entries score exactly 0 once the ReLU has
zeroed every index head); torch.topk then keeps one or the other depending on how many entries the
call holds, so the single-shot forward is "non-causal" (a prompt position's logits move once later
tokens complete a block) and the two decoding paths can part. The main references (prompts a and b)
have no such tie in the prompt or in the 24 steps, so both paths agree at every step; the "parting"
reference of fixture a (a prompt with ties at position 45 and step 3) parts at step 15. agentjax
follows the decode semantics (a token sees a compressed entry only once the entry's whole block ends
at or before it) and breaks index ties towards the lower entry (its top-k is stable). On the parting
prompt it matches transformers' cached generate at every step (step 15 included: 461, where the
uncached forward gives 235), and its prompt logits equal the single-shot forward's at every position
of that prompt (the forward that has not yet seen later tokens); BENCHMARKS.md says the same.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM, SamplingParams
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.kv.cache_layout import page_tokens_multiple
from agentjax.models import load_model
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.step import make_step

from tests.models.fixture_checkpoints import DATA, model as _model, page as _page, reference as _reference
from tests.step_buckets import pinned_buckets
FIXTURES = ("deepseek-v4-a", "deepseek-v4-b")
MIN_MARGIN = 2e-3  # transformers' top-1 margin below which a greedy token may flip on rounding





@functools.cache
def _teacher_forced(name: str) -> np.ndarray:
    """Logits over the prompt and transformers' first 23 tokens (one prefill step; shared by tests)."""
    ref = _reference(name)
    return _all_logits(name, ref["prompt_ids"].tolist() + ref["generated_ids"][:-1].tolist())


def _all_logits(name: str, ids: list[int], numerics: str = "fast") -> np.ndarray:
    """agentjax's logits at every position of `ids`, computed in one prefill step."""
    cfg, params, _ = _model(name)
    page = _page(name)
    step = make_step(cfg, numerics, all_positions=True)
    kv = cfg.new_kv_pages(2 + len(ids) // page + 1, page)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([ids], page))
    return np.asarray(logits)[: len(ids)]


def _comparable_steps(ref: dict[str, np.ndarray]) -> np.ndarray:
    """Steps where transformers' token is a well-defined target: a clear top-1 margin, its cached and
    uncached paths agree, and no indexer tie decided the step."""
    return ((ref["generated_margins"] >= MIN_MARGIN) & ref["cached_uncached_agree"]
            & ~ref["cached_indexer_boundary_tie"])


@pytest.mark.parametrize("name", FIXTURES)
def test_the_fixture_prompt_makes_the_indexer_select_and_outgrows_the_window(name):
    cfg, _, tokenizer = _model(name)
    ref = _reference(name)
    assert tokenizer is None and cfg.architecture == "deepseek_v4"
    attention = cfg.compressed_attention
    assert len(ref["prompt_ids"]) // attention.csa_rate >= 2 * attention.index_topk  # more entries than top-k
    assert len(ref["prompt_ids"]) > 4 * cfg.sliding_window
    assert _comparable_steps(ref).all()  # the main references were chosen free of ties and near-ties


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_last_prompt_position_logits_match_transformers_cached_prefill(name):
    ref = _reference(name)
    ours = _teacher_forced(name)  # causal: the prompt's logits do not depend on the tokens after it
    assert np.abs(ours[len(ref["prompt_ids"]) - 1] - ref["last_prompt_logits"]).max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_every_step_matches_transformers_cached_generate_given_its_tokens(name):
    """Teacher forcing: the prompt and transformers' 24 tokens in one prefill; our logits at each step's
    position equal its cached decode logits (so every greedy choice does), step by step."""
    ref = _reference(name)
    ours = _teacher_forced(name)[len(ref["prompt_ids"]) - 1:]
    assert np.abs(ours - ref["generated_logits"]).max() < 1e-4
    assert (ours.argmax(-1) == ref["generated_ids"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_equal_transformers_cached_generate_through_llm(name):
    ref = _reference(name)
    llm = LLM(model=str(DATA / name), num_kv_blocks=64, block_size=_page(name),  # token-id prompts
              step_buckets=pinned_buckets(128))
    out = llm.generate([ref["prompt_ids"].tolist()], SamplingParams(max_tokens=24, temperature=0.0,
                                                                     ignore_eos=True))[0]
    comparable = _comparable_steps(ref)
    assert comparable.sum() >= 20 and len(out.token_ids) == 24
    np.testing.assert_array_equal(np.asarray(out.token_ids)[comparable], ref["generated_ids"][comparable])


@pytest.mark.slow
def test_where_transformers_paths_part_agentjax_matches_its_cached_generate():
    """Fixture a's "parting" prompt: an indexer tie at prompt position 45 (the single-shot forward's
    position-45 logits move by 0.6 once later tokens complete a block) and at step 3; transformers' cached
    generate and its uncached forward then pick different tokens at step 15 (461 vs 235, margin 0.06).
    agentjax gives the cached generate's logits at all 24 steps (461 at step 15) and, on the prompt, the
    single-shot forward's logits at every position; appending tokens never changes its earlier logits."""
    ref = _reference("deepseek-v4-a", "parting")
    assert np.flatnonzero(~ref["cached_uncached_agree"]).tolist() == [15]
    assert ref["prompt_indexer_boundary_tie"].nonzero()[0].tolist() == [45]
    assert ref["noncausal_first_position"].max() == 45 and ref["noncausal_prompt_shift"].max() > 0.5
    assert (int(ref["generated_ids"][15]), int(ref["uncached_step_ids"][15])) == (461, 235)
    prompt = ref["prompt_ids"].tolist()
    ours = _all_logits("deepseek-v4-a", prompt + ref["generated_ids"][:-1].tolist())
    assert np.abs(ours[len(prompt) - 1:] - ref["generated_logits"]).max() < 1e-4
    assert (ours[len(prompt) - 1:].argmax(-1) == ref["generated_ids"]).all()
    assert np.abs(ours[:len(prompt)] - ref["prompt_logits"]).max() < 1e-4
    np.testing.assert_allclose(_all_logits("deepseek-v4-a", prompt[:46]), ours[:46], atol=1e-5)


# ---- batch-invariant exactness through the engine (fixture a: SWA, CSA and HCA layers; token-id prompts) ----
EXACT_FIXTURE = "deepseek-v4-a"
NUM_SESSIONS = 8
TURN = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _first_prompts() -> list[list[int]]:
    """Session 0 asks transformers' prompt; the others 66..94-token prompts of the same vocabulary."""
    base = _reference(EXACT_FIXTURE)["prompt_ids"].tolist()
    rng = np.random.default_rng(7)
    return [base] + [[int(t) for t in rng.integers(0, 512, 66 + 4 * s)] for s in range(1, NUM_SESSIONS)]


def _engine(**settings) -> Engine:
    cfg, params, _ = _model(EXACT_FIXTURE)
    base = dict(numerics="batch_invariant", num_kv_blocks=512, max_num_batched_tokens=256,
                step_buckets=pinned_buckets(128))  # every step one shape: the property is the cache/chunk path
    return Engine(cfg, params, EngineConfig(**{**base, **settings}))


def _run_sessions(engine: Engine, sessions: list[int]) -> dict[int, list[tuple[list[int], list[int], int]]]:
    """Two turns per session, every session's turn submitted together; the second turn's prompt is the
    first prompt, its reply and 10 new tokens. Returns per session [(prompt, reply, cached tokens)]."""
    prompts = {s: _first_prompts()[s] for s in sessions}
    follow_up = np.random.default_rng(11).integers(0, 512, (NUM_SESSIONS, 10))
    turns = {s: [] for s in sessions}
    for _ in range(2):
        ids = {engine.add_request(prompts[s], TURN, session_id=f"s{s}"): s for s in sessions}
        replies, cached = {rid: [] for rid in ids}, {}
        for out in engine.run_until_done():
            replies[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        for rid, s in ids.items():
            turns[s].append((prompts[s], replies[rid], cached[rid]))
            prompts[s] = prompts[s] + replies[rid] + [int(t) for t in follow_up[s]]
    return turns


def _replies(turns: dict) -> dict[int, list[list[int]]]:
    return {s: [reply for _, reply, _ in t] for s, t in turns.items()}


@pytest.fixture(scope="module")
def plain_run() -> dict[int, list[list[int]]]:
    """Every session alone, prefix caching off, no chunking: the reference tokens."""
    reference = {}
    for s in range(NUM_SESSIONS):
        reference.update(_replies(_run_sessions(_engine(enable_prefix_caching=False), [s])))
    assert len({tuple(replies[0]) for replies in reference.values()}) > 1  # the sessions differ
    return reference


@pytest.mark.slow
def test_batch_invariant_plain_run_gives_transformers_tokens(plain_run):
    ref = _reference(EXACT_FIXTURE)
    assert plain_run[0][0] == ref["generated_ids"][: TURN.max_tokens].tolist()


@pytest.mark.slow
def test_chunks_of_16_and_a_cached_second_turn_equal_the_plain_run(plain_run):
    engine = _engine(long_prefill_token_threshold=16)
    turns = _run_sessions(engine, [0, 5])
    assert _replies(turns) == {s: plain_run[s] for s in (0, 5)}
    assert max(n for record in engine.step_log for _, n, prefill in record.rows if prefill) <= 16
    page = _page(EXACT_FIXTURE)
    for s in (0, 5):
        (first_prompt, first_reply, first_cached), (_, _, cached) = turns[s]
        # The second turn resumes from the cached pages: whole pages, hence whole compressed entries of
        # both rates, of the first turn's computed tokens (its prompt and all but the last reply token).
        computed = len(first_prompt) + len(first_reply) - 1
        assert first_cached == 0 and cached == computed // page * page > 0


@pytest.mark.slow
def test_eight_interleaved_sessions_equal_the_plain_run(plain_run):
    assert _replies(_run_sessions(_engine(long_prefill_token_threshold=16), list(range(NUM_SESSIONS)))) == plain_run


@pytest.mark.slow
def test_preemption_in_a_small_pool_keeps_tokens_exact(plain_run):
    # The shared layout's 7 KV groups: one request may need 56 page ids; 64 with prefill chunks of 16 makes
    # later chunks preempt. The byte pool holds these sessions without preempting; its preemption is
    # tests/test_engine_kv_layout.py::test_groups_trade_memory_under_pressure_and_the_tokens_stay_those_of_a_large_pool.
    engine = _engine(num_kv_blocks=64, max_num_batched_tokens=128, long_prefill_token_threshold=16,
                     kv_layout="shared")
    turns = _run_sessions(engine, list(range(NUM_SESSIONS)))
    assert engine.scheduler.num_preemptions > 0 and any(record.preempted for record in engine.step_log)
    assert _replies(turns) == plain_run

