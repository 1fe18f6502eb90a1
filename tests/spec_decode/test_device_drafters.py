"""Speculative decoding with drafts proposed on the device: the "mtp" method (the MTP modules of
tiny-minimax-m3 and tiny-dsv4, chained for k > 1) and the "draft_model" method (a tiny preset drafting for
a tiny preset of the same vocabulary).

Greedy tokens in `numerics="batch_invariant"` equal the plain run's (tests/test_engine_speculative.py's
references: each session alone, no drafts, no prefix caching), alone and among 8 interleaved sessions,
with prefix caching and prefill chunks of 16. The MTP modules' own proposals are a function of the
tokens alone: drafts proposed at the same tokens in a run whose scripted drafts are accepted in full, in
part and not at all equal those of a run with the MTP's own drafts (its KV rolls back with the target's), and
the first of them equal the k = 1 run's. Both presets have one MTP module, so k = 5 chains it as k = 3 would;
the MTP runs use k = 1 (no chain) and k = 5 only, each step shape compiled once per k (seconds per shape).
A draft model at temperature 1 keeps the target's distribution (rejection sampling, chi-square at 1%) and
seeded requests repeat their tokens; bad configs are refused at start-up.
"""
from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import numpy as np
import pytest

from agentjax.errors import SpeculativeConfigError
from agentjax.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from chi_square import SIGNIFICANCE, chi_square_homogeneity  # noqa: E402
import test_engine_speculative as base  # noqa: E402  (its plain runs are shared, computed once)

MTP_PRESETS = ["tiny-minimax-m3", "tiny-dsv4"]


def _record_device_drafts(engine, script=None) -> dict[tuple, list[int]]:
    """The drafts the device proposes, by the tokens they follow; with `script` (a `ScriptedDrafts`) the
    rows carry the script's drafts in place of the device's."""
    speculator, proposed = engine.speculator, {}
    offer = speculator.offer

    def record(request, drafts):
        proposed[tuple(request.all_token_ids)] = list(drafts)
        offer(request, drafts)

    speculator.offer = record
    if script is not None:
        speculator.device_drafts = lambda request: script.propose(
            np.asarray(request.all_token_ids), speculator.num_speculative_tokens)
    return proposed


def _alone_then_together(engine) -> None:
    """Session 3 alone, then all 8 sessions together (session 3's turns then hit the cache), each turn's
    tokens the plain run's."""
    plain = base._plain_run(engine.model_cfg.name)
    assert base._run_sessions(engine, [3]) == {3: plain[3]}
    assert base._run_sessions(engine, list(range(base.NUM_SESSIONS))) == plain


@functools.lru_cache(maxsize=None)
def _own_mtp_drafts(name: str, k: int, together: bool = True) -> tuple:
    """A run with the MTP's own drafts, session 3 alone (then all 8 sessions): `(drafts by the tokens they
    follow, spec_decode stats)`."""
    engine = base._engine(name, k, method="mtp", long_prefill_token_threshold=16)
    proposed = _record_device_drafts(engine)
    if together:
        _alone_then_together(engine)
    else:
        assert base._run_sessions(engine, [3]) == {3: base._plain_run(name)[3]}
    engine.kv.check_invariants()
    return proposed, engine.stats()["spec_decode"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MTP_PRESETS)
@pytest.mark.parametrize("k", [1, 5])
def test_mtp_drafts_give_the_plain_runs_tokens(name, k):
    """k = 1 with one session alone; k = 5 (the chained module) alone, then among 8 sessions."""
    proposed, stats = _own_mtp_drafts(name, k, together=k > 1)
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert all(1 <= len(drafts) <= k for drafts in proposed.values())
    if k > 1:
        assert any(len(drafts) == k for drafts in proposed.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", MTP_PRESETS)
def test_mtp_proposals_do_not_depend_on_which_drafts_were_accepted(name):
    """k = 5 with scripted drafts accepted in full, in part and not at all: tokens stay the plain run's, and
    at every token sequence both runs reach the MTP proposes what it proposed in the k = 5 run with its own
    (rejected) drafts, and first what the k = 1 run proposed: its KV at accepted positions is right and
    rejected positions roll back."""
    engine = base._engine(name, 5, method="mtp", long_prefill_token_threshold=16)
    proposed = _record_device_drafts(engine, base.ScriptedDrafts(name))
    _alone_then_together(engine)
    stats = engine.stats()["spec_decode"]
    assert stats["accepted_per_position"][4] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    own, _ = _own_mtp_drafts(name, 5)
    shared = proposed.keys() & own.keys()
    assert len(shared) >= 20
    mismatched = [key for key in shared if proposed[key] != own[key]]
    assert not mismatched, f"{len(mismatched)} of {len(shared)} proposals differ"
    own_k1, _ = _own_mtp_drafts(name, 1, together=False)
    shared_k1 = proposed.keys() & own_k1.keys()
    assert len(shared_k1) >= 5
    assert [proposed[key][0] for key in shared_k1] == [own_k1[key][0] for key in shared_k1]
    engine.kv.check_invariants()


def _perturbed_tiny_dense(scale: float, model=None):
    """tiny-dense (or `model`) with noise of `scale` standard deviations on its embedding (the tied LM head):
    a draft that agrees with the target often but not always (measured over 60 positions: argmax 83% alike
    at 0.03, 58% at 0.1; the random model's logits spread little)."""
    import jax
    import jax.numpy as jnp

    cfg, params, tokenizer = model or base._model("tiny-dense")
    embed = params["embed"][...]
    noise = jax.random.normal(jax.random.PRNGKey(1), embed.shape, embed.dtype) * scale * jnp.std(embed)
    changed = jax.tree.map(lambda x: x, params)
    changed["embed"].value = embed + noise
    return cfg, changed, tokenizer


@pytest.mark.slow
def test_a_draft_model_gives_the_plain_runs_tokens_alone_and_among_eight_sessions():
    engine = base._engine("tiny-dense", 3, method="draft_model", draft_model=_perturbed_tiny_dense(0.03),
                          long_prefill_token_threshold=16)
    _alone_then_together(engine)
    stats = engine.stats()["spec_decode"]
    assert stats["accepted_per_position"][2] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert engine.kv.stats()["hits"] > 0  # the draft's own groups hit the prefix cache with the target's
    engine.kv.check_invariants()


@pytest.mark.slow
def test_a_tiny_preset_drafts_for_another_of_the_same_vocabulary():
    """tiny-dense (2 layers of GQA) drafting for tiny-minimax-m3 (block-sparse attention, MoE): its own KV
    groups follow the target's in one manager; k = 5, 8 sessions."""
    engine = base._engine("tiny-minimax-m3", 5, method="draft_model", long_prefill_token_threshold=16)
    # the pool's page groups: the target's (K/V and indexer keys packed), then the draft model's
    owners = [group.spec.owner for group in engine.kv.plan.groups]
    assert owners == [0, 1] and {kind.owner for kind in engine.kv.layout.kinds} == {0, 1}
    assert base._run_sessions(engine, list(range(base.NUM_SESSIONS))) == base._plain_run("tiny-minimax-m3")
    assert engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    engine.kv.check_invariants()


@functools.lru_cache(maxsize=None)
def _small_vocab_tiny_dense():
    """tiny-dense with a vocabulary of 4096 (random weights, token-id prompts): the rejection-sampling test
    draws 1200 requests at temperature 1, and each drawn row sorts its vocabulary's logits (top-k/top-p) in
    the target's sampler, the draft's and each draft step, which at SmolLM2's 49,152 tokens costs seconds a
    step on a CPU."""
    from agentjax.models.params import random_params

    cfg = base._model("tiny-dense")[0].replace(vocab_size=4096, name="tiny-dense-4k")
    return cfg, random_params(cfg), None


def _draws(seeds, k: int | None, prompt: list[int], draft_model=None, numerics: str = "fast",
           others: int = 0) -> tuple[list[tuple], dict | None]:
    """One request per seed at temperature 1 (top-k 4), all at once, plus `others` requests of another
    prompt beside them, on `_small_vocab_tiny_dense`: each seeded request's tokens, and the stats."""
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine

    cfg, params, tokenizer = _small_vocab_tiny_dense()
    # one shape per arm (test_engine_speculative.STEP_BUCKETS' reason): 1,024 tokens, 128 rows, 512 sampled
    # positions with drafts (128 rows x 3), 8 pages per row (prompts of 23 tokens)
    settings = dict(numerics=numerics, num_kv_blocks=1024, max_num_batched_tokens=1024, max_num_seqs=128,
                    step_buckets={"tokens": [1024], "rows": [128, 512], "pages": [8]})
    if k is not None:
        settings["speculative_config"] = {"method": "draft_model", "num_speculative_tokens": k,
                                          "model": "preset:tiny-dense"}
    engine = Engine(cfg, params, EngineConfig(**settings), tokenizer, draft_model=draft_model)
    sampling = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True) for seed in seeds]
    ids = [engine.add_request(prompt, sp) for sp in sampling]
    for index in range(others):
        engine.add_request(base._first_prompt(1), SamplingParams(max_tokens=5, temperature=1.0, seed=index))
    got = {rid: [] for rid in ids}
    for out in engine.run_until_done():
        if out.request_id in got:
            got[out.request_id].extend(out.new_token_ids)
    return [tuple(got[rid]) for rid in ids], engine.stats().get("spec_decode")


NUM_DRAWS = 600


@pytest.mark.slow
def test_draft_model_rejection_sampling_keeps_the_distribution_and_seeded_requests_repeat():
    """Independent seeds per arm (0..N-1 plain, N..2N-1 with a draft model that often disagrees): the joint
    distribution of the first 3 tokens passes a chi-square homogeneity test at the 1% level. In
    batch-invariant numerics a seeded request draws the same tokens alone and beside other requests."""
    prompt = base._first_prompt(0)
    draft = _perturbed_tiny_dense(0.1, _small_vocab_tiny_dense())
    plain, _ = _draws(range(NUM_DRAWS), None, prompt)
    drafted, stats = _draws(range(NUM_DRAWS, 2 * NUM_DRAWS), 2, prompt, draft)
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    statistic, dof, p_value = chi_square_homogeneity(collections.Counter(plain), collections.Counter(drafted))
    assert dof >= 10, f"too few distinct continuations to test: {collections.Counter(plain).most_common(5)}"
    assert p_value > SIGNIFICANCE, f"chi2={statistic:.1f} on {dof} dof, p={p_value:.4f}"
    alone, _ = _draws(range(8), 2, prompt, draft, numerics="batch_invariant")
    among, stats = _draws(range(8), 2, prompt, draft, numerics="batch_invariant", others=12)
    assert alone == among and stats["num_draft_tokens"] > 0


def test_bad_draft_configs_are_refused_at_start_up():
    from agentjax.models.params import random_params

    cfg = base._model("tiny-dense")[0].replace(vocab_size=1000, name="small-vocab")
    with pytest.raises(SpeculativeConfigError, match="vocabulary of 1000 tokens"):
        base._engine("tiny-dense", 2, method="draft_model", draft_model=(cfg, random_params(cfg), None))
    with pytest.raises(SpeculativeConfigError, match="could not be loaded.*no-such-preset"):
        _engine_with_draft("preset:no-such-preset")
    with pytest.raises(SpeculativeConfigError, match="needs a model with MTP modules"):
        base._engine("tiny-dense", 2, method="mtp")
    with pytest.raises(SpeculativeConfigError, match="recurrent state"):
        base._engine("tiny-dense", 2, method="draft_model", draft_model=base._model("tiny-kimi-k3"))


def _engine_with_draft(spec: str):
    from agentjax.config import EngineConfig
    from agentjax.engine import Engine

    cfg, params, tokenizer = base._model("tiny-dense")
    config = EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": spec})
    return Engine(cfg, params, config, tokenizer)
