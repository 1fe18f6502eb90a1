"""MiniMax-M3 against transformers 5.24.0 (the fixtures' reference.npz from scripts/make_model_fixtures.py):
prompt logits and greedy tokens through `LLM(model=dir)` with token-id prompts, the indexer's block
selection really dropping blocks, and batch-invariant exactness through the engine (alone, chunked,
cached second turns, preemption, interleaved sessions)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from agentjax import LLM, SamplingParams
from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.models import load_model
from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.step import make_step

from tests.models.fixture_checkpoints import DATA, model as _model, reference as _reference
from tests.step_buckets import pinned_buckets
FIXTURES = ("minimax-m3-a", "minimax-m3-b")
MIN_MARGIN = 2e-3  # transformers' top-1 margin below which a greedy token may flip on rounding




def _prompt_logits(cfg, params, ids: list[int], numerics: str = "fast", page_size: int = 16) -> np.ndarray:
    step = make_step(cfg, numerics, all_positions=True)
    kv = cfg.new_kv_pages(2 + len(ids) // page_size + 1, page_size)
    logits, _ = step(params, kv, RaggedBatch.from_prompts([ids], page_size))
    return np.asarray(logits)[: len(ids)]


@pytest.mark.parametrize("name", FIXTURES)
def test_prompt_logits_match_transformers(name):
    cfg, params, tokenizer = _model(name)
    ref = _reference(name)
    assert tokenizer is None and cfg.architecture == "minimax_m3"
    ours = _prompt_logits(cfg, params, ref["prompt_ids"].tolist())
    assert np.abs(ours - ref["prompt_logits"]).max() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_match_transformers_through_llm(name):
    ref = _reference(name)
    llm = LLM(model=str(DATA / name), num_kv_blocks=32, step_buckets=pinned_buckets(128))
    out = llm.generate([ref["prompt_ids"].tolist()], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    confident = ref["generated_margins"] >= MIN_MARGIN
    assert confident.sum() >= 20  # the fixtures were made with clear margins
    assert len(out.token_ids) == 24
    np.testing.assert_array_equal(np.asarray(out.token_ids)[confident], ref["generated_ids"][confident])


@pytest.mark.parametrize("name", FIXTURES)
def test_the_indexer_selects_fewer_blocks_than_the_prompt_has(name):
    """With top-k raised to every block, attention is dense and the logits move away from
    transformers': the block selection really drops blocks, and ours drops the same ones."""
    cfg, params, _ = _model(name)
    ref = _reference(name)
    ids = ref["prompt_ids"].tolist()
    sparse = cfg.block_sparse
    num_blocks = -(-len(ids) // sparse.block_size)
    assert num_blocks > 2 * sparse.topk_blocks
    dense_cfg = cfg.replace(block_sparse=dataclasses.replace(sparse, topk_blocks=num_blocks))
    dense = _prompt_logits(dense_cfg, params, ids)
    assert np.abs(dense - ref["prompt_logits"]).max() > 1e-2
    within_top_k = sparse.block_size * sparse.topk_blocks  # queries with at most top-k causal blocks
    assert np.abs(dense[:within_top_k] - ref["prompt_logits"][:within_top_k]).max() < 1e-4


# ---- batch-invariant exactness through the engine (fixture b, token-id prompts) --------------------
EXACT_FIXTURE = "minimax-m3-b"
NUM_SESSIONS = 8
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _first_prompts() -> list[list[int]]:
    ids = _reference(EXACT_FIXTURE)["prompt_ids"].tolist()
    return [(ids[7 * s:] + ids[: 7 * s])[: 40 + 4 * s] for s in range(NUM_SESSIONS)]


def _engine(**settings) -> Engine:
    cfg, params, _ = _model(EXACT_FIXTURE)
    # every step one shape (at most 8 rows of 16-token chunks, or 40-80-token prompts one at a time):
    # the property is the cache, chunk and preemption paths
    base = dict(numerics="batch_invariant", num_kv_blocks=128, max_num_batched_tokens=512,
                step_buckets=pinned_buckets(128))
    return Engine(cfg, params, EngineConfig(**{**base, **settings}))


def _run_sessions(engine: Engine, sessions: list[int]) -> dict[int, list[tuple[list[int], int]]]:
    """Two turns per session, every session's turn submitted together; the second turn is the first
    prompt, its reply and a few new ids. Returns each session's (reply, cached tokens) per turn."""
    prompts = {s: _first_prompts()[s] for s in sessions}
    turns = {s: [] for s in sessions}
    for turn in range(2):
        ids = {engine.add_request(prompts[s], GREEDY, session_id=f"s{s}"): s for s in sessions}
        replies, cached = {rid: [] for rid in ids}, {}
        for out in engine.run_until_done():
            replies[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        for rid, s in ids.items():
            turns[s].append((replies[rid], cached[rid]))
            prompts[s] = prompts[s] + replies[rid] + [(17 * s + 5 * turn + k) % 500 for k in range(5)]
    return turns


def _tokens(turns: dict) -> dict[int, list[list[int]]]:
    return {s: [reply for reply, _ in t] for s, t in turns.items()}


@pytest.fixture(scope="module")
def plain_run() -> dict[int, list[list[int]]]:
    """Each session alone, no prefix caching, no chunking: the reference tokens."""
    reference = {}
    for s in range(NUM_SESSIONS):
        reference.update(_tokens(_run_sessions(_engine(enable_prefix_caching=False), [s])))
    assert all(len(reply) == GREEDY.max_tokens for replies in reference.values() for reply in replies)
    assert len({tuple(replies[0]) for replies in reference.values()}) > 1  # the sessions differ
    return reference


@pytest.mark.slow
def test_chunks_of_16_and_a_cached_second_turn_equal_the_plain_run(plain_run):
    for s in (0, 7):
        turns = _run_sessions(_engine(long_prefill_token_threshold=16), [s])
        assert _tokens(turns)[s] == plain_run[s]
        assert turns[s][1][1] >= 32  # the second turn resumed from cached pages


@pytest.mark.slow
def test_eight_interleaved_sessions_equal_the_plain_run(plain_run):
    assert _tokens(_run_sessions(_engine(long_prefill_token_threshold=16), list(range(NUM_SESSIONS)))) == plain_run


@pytest.mark.slow
def test_preemption_in_a_small_pool_keeps_tokens_exact(plain_run):
    # The shared layout: two KV groups share the 17 usable page ids. The byte pool packs them into one group
    # and holds these sessions without preempting; its preemption is
    # tests/test_engine_kv_layout.py::test_groups_trade_memory_under_pressure_and_the_tokens_stay_those_of_a_large_pool.
    engine = _engine(num_kv_blocks=18, max_num_batched_tokens=128, kv_layout="shared")
    turns = _run_sessions(engine, list(range(NUM_SESSIONS)))
    assert engine.scheduler.num_preemptions > 0
    assert any(record.preempted for record in engine.step_log)
    assert _tokens(turns) == plain_run
