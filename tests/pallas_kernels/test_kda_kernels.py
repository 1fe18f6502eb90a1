"""The KDA kernels (the decode step and the chunked scan over the state pages) against the KDA
reference op in fast numerics, in interpret mode: decode batches, prefill chunks beside 1-token
decodes, resumed rows, fresh rows on recycled pages, padding rows, several layer slots."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels import kda
from pallas_kernels.kda_recurrence import state_size
from pallas_kernels.kda_kernels import delta_rule_kernel, kimi_delta_attention_kernel

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

STATIC = ("num_heads", "head_dim", "batch_invariant", "chunk_size")


def _step(rows, *, heads, dim, kernel=4, seed, num_slots=2, strong_decay=False):
    """Random op inputs for `rows` = [(new tokens, tokens already computed)], each row on its own
    state page holding a random (recycled or resumed) state."""
    rng = np.random.default_rng(seed)
    size = state_size(heads, dim, kernel)
    pages = rng.permutation(np.arange(1, len(rows) + 3))[:len(rows)]
    batch = RaggedBatch.build([([0] * new, done, [int(page)]) for (new, done), page in zip(rows, pages)], 16,
                              state_groups=(0,))
    tokens, channels = batch.num_tokens, 3 * heads * dim
    low, high = (np.log(0.5), np.log(30.0)) if strong_decay else (np.log(1e-3), np.log(4.6))
    inputs = dict(
        mixed_qkv=jnp.asarray(rng.normal(size=(tokens, channels)), jnp.float32),
        g=jnp.asarray(-np.exp(rng.uniform(low, high, size=(tokens, heads, dim))), jnp.float32),
        beta=jnp.asarray(rng.uniform(size=(tokens, heads)), jnp.float32),
        conv_weight=jnp.asarray(rng.normal(size=(channels, kernel)) * 0.5, jnp.float32),
        state_pages=jnp.asarray(rng.normal(size=(num_slots, len(rows) + 3, size)) * 0.3, jnp.float32),
    )
    return batch, inputs


def _call(fn, batch, inputs, **options):
    return fn(inputs["mixed_qkv"], inputs["g"], inputs["beta"], inputs["conv_weight"], inputs["state_pages"],
              batch.cu_q_lens, batch.kv_lens, batch.page_indices[0][:, 0], slot=jnp.int32(1),
              token_seq_ids=batch.seq_ids, **options)


def _compare(rows, *, heads=2, dim=16, seed=0, atol=2e-5, kernel_options=None, **step_options):
    batch, inputs = _step(rows, heads=heads, dim=dim, seed=seed, **step_options)
    options = dict(num_heads=heads, head_dim=dim)
    reference = jax.jit(functools.partial(_call, kda.kimi_delta_attention, **options))
    kernel = jax.jit(functools.partial(_call, kimi_delta_attention_kernel, interpret=True, **options,
                                       **(kernel_options or {})))
    want_out, want_pages = reference(batch, inputs)
    got_out, got_pages = kernel(batch, inputs)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=atol, rtol=atol)
    np.testing.assert_allclose(np.asarray(got_pages), np.asarray(want_pages), atol=atol, rtol=atol)
    untouched = np.ones(got_pages.shape[1], bool)
    untouched[np.asarray(batch.page_indices[0][:, 0])[np.asarray(batch.kv_lens) > 0]] = False
    np.testing.assert_array_equal(np.asarray(got_pages)[:, untouched], np.asarray(inputs["state_pages"])[:, untouched])
    np.testing.assert_array_equal(np.asarray(got_pages)[0], np.asarray(inputs["state_pages"])[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_step_matches_the_reference_on_resumed_and_fresh_rows(seed):
    _compare([(1, 9), (1, 0), (1, 30), (1, 64)], seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_scan_matches_the_reference_beside_one_token_decodes(seed):
    _compare([(1, 9), (37, 0), (1, 40), (20, 16), (1, 0)], seed=seed)


def test_chunk_boundaries_at_and_around_sixteen_tokens():
    _compare([(15, 3), (16, 0), (17, 5), (32, 64), (33, 0)], seed=3)


def test_strong_decays_stay_finite_and_match():
    _compare([(40, 0), (1, 7), (18, 30)], seed=4, strong_decay=True, atol=5e-5)


@pytest.mark.parametrize("dim,value_block", [(8, None), (16, 16), (32, 16), (24, None)])
def test_head_dims_and_value_blocks(dim, value_block):
    _compare([(1, 3), (19, 0), (1, 0)], dim=dim, heads=3, seed=dim, kernel_options=dict(value_block=value_block))


def test_a_500_token_prefill_chunk_beside_decodes():
    _compare([(1, 40), (500, 37), (1, 1), (3, 0)], heads=1, dim=16, seed=5, atol=5e-5)


def test_batch_invariant_numerics_keep_the_reference():
    batch, inputs = _step([(5, 0), (1, 3)], heads=2, dim=8, seed=6)
    options = dict(num_heads=2, head_dim=8, batch_invariant=True)
    want = jax.jit(functools.partial(_call, kda.kimi_delta_attention, **options))(batch, inputs)
    got = jax.jit(functools.partial(_call, kimi_delta_attention_kernel, **options))(batch, inputs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_rejects_state_pages_too_small_for_the_heads():
    q = jnp.zeros((4, 2, 8))
    with pytest.raises(KernelShapeError, match="128 floats"):
        delta_rule_kernel(q, q, q, q, jnp.zeros((4, 2)), jnp.zeros((1, 2, 100)), jnp.array([0, 4]), jnp.array([4]),
                          jnp.array([1]), slot=0, decode=False, interpret=True)
