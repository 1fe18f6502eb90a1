"""The Triton-style MLA paged attention kernel against its jnp reference, in interpret mode: mixed
batches of decodes and prefill chunks, page boundaries, head tiles, KV splits, bfloat16."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.mla_attention import mla_paged_attention, mla_paged_attention_kernel

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _random_step(rows, *, page_size, heads, value_dim, rope_dim, seed, dtype=jnp.float32, num_slots=2):
    """A batch of `rows` = [(new tokens, tokens already cached)] over shuffled pages and a random cache."""
    rng = np.random.default_rng(seed)
    needed = [-(-(new + cached) // page_size) for new, cached in rows]
    pages = rng.permutation(np.arange(1, 1 + sum(needed) + 3)).tolist()
    tables = []
    for count in needed:
        tables.append(pages[:count])
        pages = pages[count:]
    batch = RaggedBatch.build([([1] * new, cached, table) for (new, cached), table in zip(rows, tables)], page_size)
    width = value_dim + rope_dim
    latent_pages = jnp.asarray(rng.standard_normal((num_slots, 4 + sum(needed), page_size, width)), dtype)
    q = jnp.asarray(rng.standard_normal((batch.num_tokens, heads, width)), dtype)
    latent = jnp.asarray(rng.standard_normal((batch.num_tokens, width)), dtype)
    return batch, latent_pages, q, latent


def _attend(fn, batch, latent_pages, q, latent, **options):
    return fn(q, latent, latent_pages, batch.page_indices[0], layer=jnp.int32(1), token_seq_ids=batch.seq_ids,
              token_positions=batch.positions, slot_mapping=batch.slot_mapping[0], kv_lens=batch.kv_lens,
              cu_q_lens=batch.cu_q_lens, **options)


def _compare(rows, *, page_size=4, heads=3, value_dim=16, rope_dim=8, seed=0, dtype=jnp.float32, atol=2e-5,
             kernel_options=None):
    batch, latent_pages, q, latent = _random_step(rows, page_size=page_size, heads=heads, value_dim=value_dim,
                                                  rope_dim=rope_dim, seed=seed, dtype=dtype)
    options = dict(value_dim=value_dim, sm_scale=(value_dim + rope_dim) ** -0.5, return_lse=True)
    reference = jax.jit(functools.partial(_attend, mla_paged_attention, **options))
    kernel = jax.jit(functools.partial(_attend, mla_paged_attention_kernel, interpret=True, **options,
                                       **(kernel_options or {})))
    want_out, want_pages, want_lse = reference(batch, latent_pages, q, latent)
    got_out, got_pages, got_lse = kernel(batch, latent_pages, q, latent)
    real = int(batch.cu_q_lens[-1])
    np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))
    np.testing.assert_allclose(np.asarray(got_out[:real], np.float32), np.asarray(want_out[:real], np.float32),
                               atol=atol, rtol=atol)
    np.testing.assert_allclose(np.asarray(got_lse[:real]), np.asarray(want_lse[:real]), atol=atol, rtol=atol)
    assert not np.asarray(got_out[real:]).any(), "padding tokens get zeros"
    assert np.isneginf(np.asarray(got_lse[real:])).all(), "padding tokens get LSE -inf"


MIXED_ROWS = [(1, 9), (7, 0), (1, 30), (12, 5), (1, 0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference_on_a_mixed_batch(seed):
    _compare(MIXED_ROWS, seed=seed)


@pytest.mark.parametrize("kernel_options", [
    dict(head_block=2, query_rows=16),
    dict(head_block=1, query_rows=32, kv_block=16),
    dict(num_kv_splits=3, kv_block=16),
    dict(head_block=4, query_rows=64, num_kv_splits=2),
], ids=["tile2", "tile1_rows32", "split3", "tile4_split2"])
def test_head_tiles_and_kv_splits_do_not_change_the_result(kernel_options):
    _compare(MIXED_ROWS, heads=5, seed=4, kernel_options=kernel_options)


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_kernel_crosses_page_boundaries(page_size):
    _compare([(3, page_size - 1 if page_size > 1 else 4), (1, 2 * page_size), (5, 3 * page_size + 1)],
             page_size=page_size, seed=page_size)


@pytest.mark.parametrize("value_dim,rope_dim", [(32, 0), (24, 8), (16, 12)])
def test_latent_and_rope_widths_that_are_not_powers_of_two(value_dim, rope_dim):
    _compare(MIXED_ROWS, value_dim=value_dim, rope_dim=rope_dim, seed=7)


def test_kernel_in_bfloat16_stays_within_bfloat16_rounding():
    _compare(MIXED_ROWS, dtype=jnp.bfloat16, atol=3e-2, seed=8)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_on_decodes_beside_a_500_token_prefill_chunk(seed):
    _compare([(1, 40), (500, 37), (1, 1), (1, 130), (3, 0)], page_size=16, heads=4, seed=seed)


def test_kernel_rejects_a_latent_width_that_does_not_fit():
    batch, latent_pages, q, latent = _random_step([(2, 1)], page_size=4, heads=2, value_dim=16, rope_dim=8, seed=0)
    with pytest.raises(KernelShapeError, match="value_dim=30"):
        _attend(mla_paged_attention_kernel, batch, latent_pages, q, latent, value_dim=30, sm_scale=0.2,
                interpret=True)
