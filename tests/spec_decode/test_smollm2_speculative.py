"""Speculative decoding on the real model (SmolLM2): n-gram drafts with k = 1, 3 and 5 give exactly the
plain run's greedy tokens in `numerics="batch_invariant"`, alone and among 8 interleaved sessions, with
prefix caching and prefill chunks of 16, and so does SmolLM2 drafting for itself ("draft_model"); at
temperature 1 a chi-square test over many seeded draws finds the distribution of the first tokens with
n-gram drafts the same as without them."""
from __future__ import annotations

import collections
import gc
import sys
from pathlib import Path

import pytest

from agentjax.config import EngineConfig
from agentjax.engine import Engine
from agentjax.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from chi_square import SIGNIFICANCE, chi_square_homogeneity  # noqa: E402

# 16 tokens hold most of each line's copy; the plain reference runs every session alone, one decode step
# (of the real model, in batch-invariant numerics) per token, so each token costs 16 steps.
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LINES = [
    "def area(radius): return 3.14159 * radius * radius",
    "for item in items: total += item.price * item.count",
    "The train leaves the station at nine and reaches the coast by noon.",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;",
    "x = [i * i for i in range(10) if i % 2 == 0]",
    "Tea is brewed with water just below boiling for three minutes.",
    "while queue: node = queue.pop(0); visit(node); queue.extend(node.children)",
    "The map shows the river, the bridge, the mill and the old road north.",
]
NUM_SESSIONS = len(LINES)


def _engine(llm, k: int | None = None, **settings) -> Engine:
    base = dict(numerics="batch_invariant", num_kv_blocks=512, max_num_batched_tokens=512)
    if k is not None:
        base["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                      "prompt_lookup_max": 4}
    return Engine(llm.model_config, llm.params, EngineConfig(**{**base, **settings}), llm.tokenizer)


def _run_sessions(engine: Engine, tokenizer, sessions: list[int]) -> dict[int, list[list[int]]]:
    """Two turns per session (the second asks for the line again), submitted together."""
    history = {s: [{"role": "user", "content": f"Repeat this line exactly: {LINES[s]}"}] for s in sessions}
    replies = {s: [] for s in sessions}
    for _ in range(2):
        ids = {engine.add_request(tokenizer.encode_chat(history[s]), GREEDY, session_id=f"s{s}"): s for s in sessions}
        got = {rid: [] for rid in ids}
        for out in engine.run_until_done():
            got[out.request_id].extend(out.new_token_ids)
        for rid, s in ids.items():
            replies[s].append(got[rid])
            history[s] += [{"role": "assistant", "content": tokenizer.decode(got[rid])},
                           {"role": "user", "content": "Once more, exactly."}]
    return replies


@pytest.fixture(scope="module")
def plain_run(smollm2_invariant):
    reference = {}
    for s in range(NUM_SESSIONS):
        reference.update(_run_sessions(_engine(smollm2_invariant, enable_prefix_caching=False),
                                       smollm2_invariant.tokenizer, [s]))
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_drafts_give_the_plain_runs_tokens_alone_and_among_eight_sessions(smollm2_invariant, plain_run, k):
    tokenizer = smollm2_invariant.tokenizer
    alone = _engine(smollm2_invariant, k, long_prefill_token_threshold=16)
    assert _run_sessions(alone, tokenizer, [k]) == {k: plain_run[k]}
    together = _engine(smollm2_invariant, k, long_prefill_token_threshold=16)
    assert _run_sessions(together, tokenizer, list(range(NUM_SESSIONS))) == plain_run
    stats = together.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0  # the copies are drafted and accepted
    if k > 1:  # more than one token accepted per draft on average: whole runs of the line are copied
        assert stats["num_accepted_tokens"] > stats["num_drafts"]
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]


NUM_DRAWS = 600


@pytest.mark.slow
def test_drafts_keep_the_sampling_distribution_at_temperature_one(smollm2_fast):
    """Independent seeds for each arm (0..N-1 without drafts, N..2N-1 with), so the test compares two
    samples rather than the same draws: the joint distribution of the first three tokens must pass a
    chi-square homogeneity test at the 1% level."""
    llm = smollm2_fast
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Repeat this line exactly: " + LINES[2]}])
    prompt += llm.tokenizer.encode("The train leaves the")

    def draws(k: int | None, seeds: range):
        settings = dict(num_kv_blocks=2048, max_num_batched_tokens=2048, max_num_seqs=128)
        if k is not None:
            settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 3}
        engine = Engine(llm.model_config, llm.params, EngineConfig(**settings), llm.tokenizer)
        ids = {engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)): seed
               for seed in seeds}
        got = {rid: [] for rid in ids}
        for out in engine.run_until_done():
            got[out.request_id].extend(out.new_token_ids)
        return collections.Counter(tuple(tokens) for tokens in got.values()), engine

    plain = draws(None, range(NUM_DRAWS))[0]
    gc.collect()  # the plain run's engine and its 2,048 KV pages go before the drafting engine is built
    drafted, engine = draws(3, range(NUM_DRAWS, 2 * NUM_DRAWS))
    stats = engine.stats()["spec_decode"]
    assert stats["num_accepted_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    statistic, dof, p_value = chi_square_homogeneity(plain, drafted)
    assert dof >= 3, f"too few distinct continuations to test: {plain.most_common(5)}"
    assert p_value > SIGNIFICANCE, f"chi2={statistic:.1f} on {dof} dof, p={p_value:.4f}"


@pytest.mark.slow
def test_smollm2_drafting_for_itself_gives_the_plain_runs_tokens_among_eight_sessions(smollm2_invariant, plain_run):
    """The "draft_model" method with SmolLM2 as its own draft (k = 3): the tokens are the plain run's and,
    as the draft's KV follows every accepted and rejected token, in batch-invariant numerics the draft
    agrees with the target at every position it drafts: every draft token is accepted."""
    llm = smollm2_invariant
    config = EngineConfig(numerics="batch_invariant", num_kv_blocks=512, max_num_batched_tokens=512,
                          long_prefill_token_threshold=16,
                          speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                              "model": "smollm2-135m-instruct"})
    engine = Engine(llm.model_config, llm.params, config, llm.tokenizer,
                    draft_model=(llm.model_config, llm.params, llm.tokenizer))
    assert _run_sessions(engine, llm.tokenizer, list(range(NUM_SESSIONS))) == plain_run
    stats = engine.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert stats["num_draft_tokens"] > 2 * stats["num_drafts"]
    engine.kv.check_invariants()


def test_the_chi_square_helper_tells_equal_samples_from_shifted_ones():
    import numpy as np

    rng = np.random.default_rng(0)
    weights = np.array([0.4, 0.3, 0.2, 0.1])
    same_a = collections.Counter(rng.choice(4, 600, p=weights).tolist())
    same_b = collections.Counter(rng.choice(4, 600, p=weights).tolist())
    shifted = collections.Counter(rng.choice(4, 600, p=[0.3, 0.3, 0.2, 0.2]).tolist())
    assert chi_square_homogeneity(same_a, same_b)[2] > SIGNIFICANCE
    assert chi_square_homogeneity(same_a, shifted)[2] < 1e-3
