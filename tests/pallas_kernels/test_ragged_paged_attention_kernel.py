"""The Triton-style ragged paged attention kernel against its jnp reference, in interpret mode."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention_kernels import ragged_paged_attention_kernel


def _random_step(rows, *, page_size, num_heads, num_kv_heads, dim, seed, dtype=jnp.float32, num_layers=2):
    """A batch of `rows` = [(new tokens, tokens already cached)], pages shuffled, caches random."""
    rng = np.random.default_rng(seed)
    needed = [-(-(new + cached) // page_size) for new, cached in rows]
    pages = rng.permutation(np.arange(1, 1 + sum(needed) + 3)).tolist()
    tables = []
    for count in needed:
        tables.append(pages[:count])
        pages = pages[count:]
    batch = RaggedBatch.build([([1] * new, cached, table) for (new, cached), table in zip(rows, tables)], page_size)
    num_pages = 4 + sum(needed)
    kv_pages = jnp.asarray(rng.standard_normal((num_layers, num_pages, page_size, 2 * num_kv_heads, dim)), dtype)
    q, k, v = (jnp.asarray(rng.standard_normal((batch.num_tokens, h, dim)), dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    return batch, kv_pages, q, k, v


def _attend(fn, batch, kv_pages, q, k, v, **options):
    return fn(q, k, v, kv_pages, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens, layer=jnp.int32(1),
              token_seq_ids=batch.seq_ids, token_positions=batch.positions, slot_mapping=batch.slot_mapping[0],
              return_lse=True, **options)


def _compare(rows, *, page_size=4, num_heads=4, num_kv_heads=2, dim=16, seed=0, dtype=jnp.float32, atol=2e-5,
             kernel_options=None, **options):
    batch, kv_pages, q, k, v = _random_step(rows, page_size=page_size, num_heads=num_heads,
                                            num_kv_heads=num_kv_heads, dim=dim, seed=seed, dtype=dtype)
    options.setdefault("sm_scale", dim**-0.5)
    reference = jax.jit(functools.partial(_attend, ragged_paged_attention, **options))
    kernel = jax.jit(functools.partial(_attend, ragged_paged_attention_kernel, interpret=True, **options,
                                       **(kernel_options or {})))
    want_out, want_pages, want_lse = reference(batch, kv_pages, q, k, v)
    got_out, got_pages, got_lse = kernel(batch, kv_pages, q, k, v)
    real = int(batch.cu_q_lens[-1])
    np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))
    np.testing.assert_allclose(np.asarray(got_out[:real], np.float32), np.asarray(want_out[:real], np.float32),
                               atol=atol, rtol=atol)
    np.testing.assert_allclose(np.asarray(got_lse[:real]), np.asarray(want_lse[:real]), atol=atol, rtol=atol)
    assert not np.asarray(got_out[real:]).any(), "padding tokens get out 0"
    assert np.isneginf(np.asarray(got_lse[real:])).all(), "padding tokens get LSE -inf"


MIXED_ROWS = [(1, 9), (7, 0), (1, 30), (12, 5), (1, 0)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1), (6, 2)])
def test_kernel_matches_reference_for_gqa_ratios_on_a_mixed_batch(num_heads, num_kv_heads):
    _compare(MIXED_ROWS, num_heads=num_heads, num_kv_heads=num_kv_heads, seed=num_heads * 10 + num_kv_heads)


@pytest.mark.parametrize("options", [
    dict(sliding_window=5),
    dict(sliding_window=1),
    dict(soft_cap=2.0),
    dict(sinks=jnp.array([0.5, -1.0, 2.0, 0.0])),
    dict(sliding_window=6, soft_cap=3.0, sinks=jnp.array([-0.5, 1.0, 0.0, 3.0])),
], ids=["window5", "window1", "soft_cap", "sinks", "all"])
def test_kernel_matches_reference_with_window_soft_cap_and_sinks(options):
    _compare(MIXED_ROWS, seed=3, **options)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kernel_options", [
    dict(num_kv_splits=3, kv_block=16),
    dict(num_kv_splits=2, kv_block=32, query_rows=16),
    dict(query_rows=128, kv_block=16),
], ids=["split3", "split2_rows16", "rows128"])
def test_kernel_block_sizes_and_kv_splits_do_not_change_the_result(seed, kernel_options):
    _compare(MIXED_ROWS, seed=seed, sinks=jnp.array([0.3, 0.1, -2.0, 1.0]), sliding_window=9,
             kernel_options=kernel_options)


@pytest.mark.parametrize("page_size", [1, 2, 16, 32])
def test_kernel_crosses_page_boundaries_for_any_page_size(page_size):
    _compare([(3, page_size - 1 if page_size > 1 else 4), (1, 2 * page_size), (5, 3 * page_size + 1)],
             page_size=page_size, seed=page_size)


def test_kernel_head_dim_that_is_not_a_power_of_two():
    _compare(MIXED_ROWS, dim=24, seed=5)


def test_kernel_in_bfloat16_stays_within_bfloat16_rounding():
    _compare(MIXED_ROWS, dtype=jnp.bfloat16, atol=3e-2, seed=6, sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_on_decodes_beside_a_500_token_prefill_chunk(seed):
    rows = [(1, 40), (500, 37), (1, 1), (1, 130), (3, 0)]
    _compare(rows, page_size=16, num_heads=8, num_kv_heads=2, seed=seed, sliding_window=None if seed else 200)


def test_kernel_rejects_block_sizes_that_are_not_powers_of_two():
    batch, kv_pages, q, k, v = _random_step([(2, 1)], page_size=4, num_heads=4, num_kv_heads=2, dim=16, seed=0)
    with pytest.raises(KernelShapeError, match="kv_block=48"):
        _attend(ragged_paged_attention_kernel, batch, kv_pages, q, k, v, sm_scale=0.25, kv_block=48, interpret=True)
