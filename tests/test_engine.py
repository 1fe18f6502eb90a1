"""The engine on the real model: exactness under caching, chunking, block sizes, preemption and
interleaving; cached-token counts; prefill caps; admission cadence; compiled shapes.

All runs are greedy in `numerics="batch_invariant"` (see DESIGN.md section 4).
"""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TOPICS = ["cats", "the sea", "rust", "jazz", "tea", "trains", "maps", "bread"]
FOLLOW_UPS = ["Tell me more.", "Why?", "Give an example.", "Summarise that."]
NUM_TURNS = 5


def _engine(llm, **settings) -> Engine:
    base = dict(numerics="batch_invariant", num_kv_blocks=256, max_num_batched_tokens=2048)
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), llm.tokenizer)


def _run_sessions(engine: Engine, tokenizer, sessions: list[int]) -> dict:
    """Five turns of each session, all sessions' turn k submitted together. Returns per session
    the list of (prompt ids, reply ids, cached tokens) per turn."""
    history = {s: [{"role": "user", "content": f"Say something about {TOPICS[s]}."}] for s in sessions}
    turns = {s: [] for s in sessions}
    for turn in range(NUM_TURNS):
        ids = {}
        for s in sessions:
            prompt = tokenizer.encode_chat(history[s])
            ids[engine.add_request(prompt, GREEDY, session_id=f"s{s}")] = (s, prompt)
        replies = {rid: [] for rid in ids}
        cached = {}
        for out in engine.run_until_done():
            replies[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        for rid, (s, prompt) in ids.items():
            turns[s].append((prompt, replies[rid], cached[rid]))
            history[s].append({"role": "assistant", "content": tokenizer.decode(replies[rid])})
            history[s].append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
    return turns


def _tokens(turns: dict) -> dict:
    return {s: [reply for _, reply, _ in t] for s, t in turns.items()}


@pytest.fixture(scope="module")
def plain_run(smollm2_invariant):
    """Every session alone, prefix caching off, no chunking: the reference tokens."""
    llm = smollm2_invariant
    reference = {}
    for s in range(8):
        engine = _engine(llm, enable_prefix_caching=False)
        reference.update(_tokens(_run_sessions(engine, llm.tokenizer, [s])))
    return reference


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(long_prefill_token_threshold=16),
        dict(long_prefill_token_threshold=64),
        dict(block_size=32, num_kv_blocks=128),
    ],
    ids=["prefix-caching", "threshold-16", "threshold-64", "block-32"],
)
def test_conversation_tokens_equal_the_plain_run(smollm2_invariant, plain_run, settings):
    turns = _run_sessions(_engine(smollm2_invariant, **settings), smollm2_invariant.tokenizer, [0])
    assert _tokens(turns)[0] == plain_run[0]
    assert all(cached > 0 for _, _, cached in turns[0][1:])


@pytest.mark.slow
def test_eight_interleaved_sessions_equal_the_plain_run(smollm2_invariant, plain_run):
    engine = _engine(smollm2_invariant)
    assert _tokens(_run_sessions(engine, smollm2_invariant.tokenizer, list(range(8)))) == plain_run


@pytest.mark.slow
def test_preemption_in_a_small_pool_keeps_tokens_exact(smollm2_invariant, plain_run):
    engine = _engine(smollm2_invariant, num_kv_blocks=48, max_num_batched_tokens=256)
    turns = _run_sessions(engine, smollm2_invariant.tokenizer, list(range(8)))
    assert engine.scheduler.num_preemptions > 0
    assert any(record.preempted for record in engine.step_log)
    assert _tokens(turns) == plain_run


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
def test_cached_tokens_are_the_shared_prefix_in_whole_pages(smollm2_invariant, block_size):
    engine = _engine(smollm2_invariant, block_size=block_size, num_kv_blocks=4096 // block_size)
    turns = _run_sessions(engine, smollm2_invariant.tokenizer, [0])[0]
    for (previous_prompt, previous_reply, _), (prompt, _, cached) in zip(turns, turns[1:]):
        computed = previous_prompt + previous_reply[:-1]  # the last sampled token never got KV
        shared = next((i for i, (a, b) in enumerate(zip(computed, prompt)) if a != b), min(len(computed), len(prompt)))
        whole_pages = min(shared, len(prompt) - 1) // block_size * block_size
        assert whole_pages - block_size <= cached <= whole_pages
        assert cached % block_size == 0


@pytest.mark.slow
@pytest.mark.parametrize("threshold", [0, 32])
def test_prefill_threshold_lets_short_cached_turns_finish_first(smollm2_invariant, threshold):
    tok = smollm2_invariant.tokenizer
    engine = _engine(smollm2_invariant, long_prefill_token_threshold=threshold, max_num_batched_tokens=64)
    short_prompts = [tok.encode_chat([{"role": "user", "content": f"Hi about {t}"}]) for t in TOPICS[:3]]
    for prompt in short_prompts:  # warm the cache: the short turns will be cached turns
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    list(engine.run_until_done())
    long_prompt = tok.encode("A long fresh document. " * 60)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    long_id = engine.add_request(long_prompt, one)
    short_ids = [engine.add_request(p, one) for p in short_prompts]
    first_token_step = {}
    for out in engine.run_until_done():
        first_token_step.setdefault(out.request_id, engine.num_steps)
    assert len(long_prompt) > 4 * 64
    if threshold:
        assert all(first_token_step[s] < first_token_step[long_id] for s in short_ids)
    else:
        # without a cap they wait for the long prefill, at best sharing its last step
        assert all(first_token_step[s] >= first_token_step[long_id] for s in short_ids)


def test_prefill_schedule_interval_admits_only_every_nth_step(smollm2_invariant):
    engine = _engine(smollm2_invariant, prefill_schedule_interval=3, max_num_seqs=2)
    tok = smollm2_invariant.tokenizer
    for topic in TOPICS:
        engine.add_request(tok.encode(f"Facts about {topic}:"), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    list(engine.run_until_done())
    admitting_steps = [r.step_index for r in engine.step_log if r.admitted]
    assert len(admitting_steps) >= 4
    assert all(step % 3 == 0 for step in admitting_steps)
    assert sum(len(r.admitted) for r in engine.step_log) == len(TOPICS)


@pytest.mark.slow
def test_compiled_shapes_stay_within_buckets_over_a_mixed_run(smollm2_invariant):
    import random

    from agentjax.ragged_batch import PAGE_BUCKETS, SEQ_BUCKETS, TOKEN_BUCKETS

    engine = _engine(smollm2_invariant, max_num_batched_tokens=256, max_num_seqs=32, num_kv_blocks=512)
    tok = smollm2_invariant.tokenizer
    rng = random.Random(0)

    def submit(count):
        for _ in range(count):
            words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(1, 40)))
            engine.add_request(tok.encode(words), SamplingParams(max_tokens=rng.randint(1, 6), temperature=0, ignore_eos=True))
        list(engine.run_until_done())

    submit(100)
    shapes_after_first_half = set(engine.runner.compiled_shapes)
    submit(100)
    shapes = engine.runner.compiled_shapes
    for tokens, seqs, pages, _ in shapes:
        assert tokens in TOKEN_BUCKETS and tokens <= 256
        assert seqs in SEQ_BUCKETS and seqs <= 32
        assert all(group_pages in PAGE_BUCKETS for group_pages in pages)
    assert len(shapes) <= 12
    assert shapes - shapes_after_first_half == set()  # steady state: no new compilation
