"""The device drafters' parts on their own: rejection sampling gives the target's distribution whatever
the draft's (a goodness-of-fit test over many keys), a drafting step's host inputs say which token follows
each position, acceptance counts follow the host's rule, and chained positions write only into pages the
row holds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import chisquare

from agentjax.ragged_batch import RaggedBatch
from agentjax.runner.drafters import SpecInputs, accepted_counts, chain_batch, rejection_sample
from agentjax.runner.sampler import SamplingMetadata

PAGE = 4


def test_rejection_sampling_gives_the_targets_distribution():
    """A draft drawn from q, then `rejection_sample` against p: over 40,000 seeds the tokens follow p
    (chi-square goodness of fit at the 1% level), and about sum(min(p, q)) of the drafts are kept."""
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
    q = np.array([0.1, 0.4, 0.1, 0.2, 0.2])
    draws = 40_000
    seeds = np.arange(draws, dtype=np.uint32)
    drafts = jax.vmap(lambda s: jax.random.categorical(jax.random.PRNGKey(s + 10**6), jnp.log(q)))(seeds)
    meta = SamplingMetadata(
        temperature=np.ones(draws, np.float32), top_k=np.zeros(draws, np.int32), top_p=np.ones(draws, np.float32),
        seeds=seeds, num_generated=np.zeros(draws, np.int32), token_bitmask=np.zeros((draws, 1), np.int32))
    logits = lambda probs: jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (draws, len(probs)))  # noqa: E731
    plain = jnp.zeros(draws, jnp.int32) - 1  # never used where a draft follows
    tokens = np.asarray(jax.jit(rejection_sample)(logits(p), logits(q), drafts.astype(jnp.int32), plain, meta))
    counts = np.bincount(tokens, minlength=len(p))
    assert counts[4] == 0  # p = 0 there: never emitted, though q proposes it
    assert chisquare(counts[:4], p[:4] * draws).pvalue > 0.01
    kept = np.mean(tokens == np.asarray(drafts))
    assert abs(kept - np.minimum(p, q).sum()) < 0.01


def _rows():
    """A decode row with 2 drafts, a prefill chunk whose next token is known, and a plain decode row."""
    return [([7, 8, 9], 5, [[1, 2]]), ([1, 2, 3, 4], 0, [[3]]), ([6], 2, [[4]])]


def test_spec_inputs_name_the_token_after_each_position_and_each_samples_draft():
    batch = RaggedBatch.build(_rows(), PAGE, sample_counts=[3, 1, 1])
    spec = SpecInputs.build(batch, _rows(), [-1, 5, -1])
    # the drafting row's positions read the tokens sampled there; the chunk's last one the known token 5
    assert spec.next_token_ids[:8].tolist() == [-1, -1, -1, 2, 3, 4, 5, -1]
    assert spec.draft_ids[:5].tolist() == [8, 9, -1, -1, -1]
    assert spec.row_first_sample[:4].tolist() == [0, 3, 4, batch.num_samples]


def test_accepted_counts_keep_drafts_while_each_equals_the_token_before_it():
    batch = RaggedBatch.build(_rows(), PAGE, sample_counts=[3, 1, 1])
    spec = SpecInputs.build(batch, _rows(), [-1, 5, -1])
    for sampled, expected in (([8, 9, 11], 2), ([8, 5, 11], 1), ([3, 9, 11], 0)):
        tokens = np.zeros(batch.num_samples, np.int32)
        tokens[:3] = sampled
        accepted, last = accepted_counts(batch, spec, jnp.asarray(tokens))
        assert int(accepted[0]) == expected and int(last[0]) == expected
        assert accepted[1:3].tolist() == [0, 0] and last[1:3].tolist() == [3, 4]


def test_chained_positions_past_a_rows_pages_write_into_the_null_page():
    batch = RaggedBatch.build(_rows(), PAGE, sample_counts=[3, 1, 1])
    active = jnp.arange(batch.num_seqs) < 3
    positions = jnp.asarray([6, 9, 3] + [0] * (batch.num_seqs - 3), jnp.int32)
    chain = chain_batch(batch, positions, jnp.zeros(batch.num_seqs, jnp.int32), active, PAGE)
    # row 0 holds pages 1, 2 (positions 0-7): 6 is on page 2; row 1's position 9 is past its one page
    assert chain.slot_mapping[0][:3].tolist() == [2 * PAGE + 2, 0 * PAGE + 1, 4 * PAGE + 3]
    assert chain.kv_lens[:3].tolist() == [7, 10, 4] and chain.slot_mapping[0][3:].tolist() == [0] * (batch.num_seqs - 3)
