"""FP8 KV rows (pallas_kernels/kv_fp8.py): the packing's size and error bound, rows independent of
each other, and the references over FP8 pages (ragged paged, MLA, block-sparse attention) computing
exactly what they compute over float pages holding the dequantised values."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax import kernels
from agentjax.kv.specs import fp8_row_bytes
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.block_sparse_attention import block_sparse_attention
from pallas_kernels import kv_fp8
from pallas_kernels.kv_fp8 import row_words
from pallas_kernels.mla_attention import mla_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


# jitted once each: the eager ops would each build an executable
quantize_rows = jax.jit(kv_fp8.quantize_rows, static_argnums=1)
dequantize_rows = jax.jit(kv_fp8.dequantize_rows, static_argnums=1)


def _normal(shape, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _round_trip(x):
    return dequantize_rows(quantize_rows(x, jnp.float32), x.shape[-1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rows_pack_into_whole_words_and_come_back_within_e4m3_precision(dtype):
    x = _normal((6, 3, 24), 0, scale=5.0).at[0, 0].set(0.0).at[1, 2].set(1e-30)
    packed = quantize_rows(x, dtype)
    word = jnp.dtype(dtype).itemsize
    assert packed.dtype == dtype and packed.shape == (6, 3, row_words(24, dtype))
    assert packed.shape[-1] * word == fp8_row_bytes(24, word) == 28
    back = np.asarray(dequantize_rows(packed, 24))
    amax = np.abs(np.asarray(x)).max(axis=-1, keepdims=True)
    # e4m3: 3 mantissa bits (relative error <= 2^-4 of a normal value), subnormals below amax * 2^-6 / 448
    assert (np.abs(back - np.asarray(x)) <= np.maximum(np.abs(np.asarray(x)) * 2**-4, amax * 2**-9 / 448)).all()
    assert (back[0, 0] == 0).all()
    assert np.abs(back - np.asarray(x)).max() > 0  # 8-bit values do lose precision


def test_a_rows_bytes_depend_on_that_row_alone():
    x = _normal((9, 2, 16), 1)
    whole = np.asarray(quantize_rows(x, jnp.float32)).view(np.uint32)
    alone = np.stack([np.asarray(quantize_rows(x[i:i + 1], jnp.float32))[0] for i in range(9)]).view(np.uint32)
    np.testing.assert_array_equal(whole, alone)


def _step(page_size=4):
    """Two rows: 5 new tokens over 6 cached, and 3 new tokens alone, over shuffled pages."""
    return RaggedBatch.build([([1] * 5, 6, [3, 1, 5]), ([1] * 3, 0, [2])], page_size)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_ragged_paged_attention_over_fp8_pages_is_the_float_attention_of_the_dequantised_values(
        batch_invariant, window):
    batch = _step()
    float_pages = _normal((2, 7, 4, 4, 16), 2)  # [layers, pages, page_size, 2 x 2 KV heads, dim]
    fp8_pages = quantize_rows(float_pages, jnp.float32)
    q, k, v = (_normal((batch.num_tokens, h, 16), 3 + h) for h in (4, 2, 2))
    options = dict(layer=1, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                   slot_mapping=batch.slot_mapping[0], sm_scale=0.25, sliding_window=window,
                   batch_invariant=batch_invariant)
    rest = (batch.kv_lens, batch.page_indices[0], batch.cu_q_lens)
    got, got_pages = jax.jit(lambda *a: ragged_paged_attention(*a, fp8_kv=True, **options))(q, k, v, fp8_pages, *rest)
    want, want_pages = jax.jit(lambda *a: ragged_paged_attention(*a, **options))(
        q, _round_trip(k), _round_trip(v), dequantize_rows(fp8_pages, 16), *rest)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(dequantize_rows(got_pages, 16)), np.asarray(want_pages))
    assert got_pages.shape == (2, 7, 4, 4, row_words(16, jnp.float32))


def test_mla_attention_over_fp8_pages_is_the_float_attention_of_the_dequantised_values():
    batch = _step()
    float_pages = _normal((2, 7, 4, 24), 4)  # latent 16 + rope 8
    fp8_pages = quantize_rows(float_pages, jnp.bfloat16)
    q, latent = _normal((batch.num_tokens, 3, 24), 5), _normal((batch.num_tokens, 24), 6)
    options = dict(layer=1, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                   slot_mapping=batch.slot_mapping[0], value_dim=16, sm_scale=0.2, batch_invariant=True)
    table = batch.page_indices[0]
    got, got_pages = jax.jit(lambda *a: mla_paged_attention(*a, fp8_kv=True, **options))(q, latent, fp8_pages, table)
    want, want_pages = jax.jit(lambda *a: mla_paged_attention(*a, **options))(
        q, _round_trip(latent), dequantize_rows(fp8_pages, 24), table)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(dequantize_rows(got_pages, 24)), np.asarray(want_pages))


def test_block_sparse_attention_over_fp8_pages_is_the_float_attention_of_the_dequantised_values():
    batch = _step()
    float_pages = _normal((1, 7, 4, 4, 16), 7)
    fp8_pages = quantize_rows(float_pages, jnp.float32)
    q, k, v = (_normal((batch.num_tokens, h, 16), 8 + h) for h in (4, 2, 2))
    selected = jnp.asarray(np.tile(np.array([[[0, 2, -1], [1, -1, -1]]], np.int32), (batch.num_tokens, 1, 1)))
    options = dict(slot=0, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                   slot_mapping=batch.slot_mapping[0], sm_scale=0.25, block_size=4)
    table = batch.page_indices[0]
    got, got_pages = jax.jit(lambda *a: block_sparse_attention(*a, fp8_kv=True, **options))(
        q, k, v, fp8_pages, table, selected)
    want, want_pages = jax.jit(lambda *a: block_sparse_attention(*a, **options))(
        q, _round_trip(k), _round_trip(v), dequantize_rows(fp8_pages, 16), table, selected)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(dequantize_rows(got_pages, 16)), np.asarray(want_pages))


def test_the_kernel_path_refuses_fp8_pages_and_auto_takes_the_reference():
    batch = _step()
    fp8_pages = quantize_rows(_normal((1, 7, 4, 4, 16), 2), jnp.float32)
    q, k, v = (_normal((batch.num_tokens, h, 16), 3 + h) for h in (4, 2, 2))
    args = (q, k, v, fp8_pages, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens)
    options = dict(layer=0, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                   slot_mapping=batch.slot_mapping[0], sm_scale=0.25, fp8_kv=True)
    with pytest.raises(NotImplementedError, match="ragged_paged_attention: FP8 KV pages"):
        kernels.ragged_paged_attention(*args, impl="kernel", **options)
    out, _ = jax.jit(lambda *a: kernels.ragged_paged_attention(*a, impl="auto", **options))(*args)
    want, _ = jax.jit(lambda *a: ragged_paged_attention(*a, **options))(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert kernels.resolve_attention_impl("auto", backend="gpu", fp8_kv=True) == "reference"
