"""MiniMax-M3's block indexer kernels (block scores, local forcing, top-k) and the block-sparse
attention kernel against their jnp references, in interpret mode: mixed batches of 1-token decodes
and prefill chunks, page boundaries, block sizes below and above the key tile, top-k larger than
the context, head layouts."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.block_sparse_attention import block_sparse_attention, index_select_blocks
from pallas_kernels.block_sparse_attention_kernels import (
    block_sparse_attention_kernel,
    index_select_blocks_kernel,
)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _step(rows, *, page_size, heads, kv_heads, index_heads, dim, index_dim, seed, dtype=jnp.float32):
    """A batch of `rows` = [(new tokens, tokens already cached)] over shuffled pages and random caches."""
    rng = np.random.default_rng(seed)
    needed = [-(-(new + cached) // page_size) for new, cached in rows]
    pages = rng.permutation(np.arange(1, 1 + sum(needed) + 3)).tolist()
    tables = []
    for count in needed:
        tables.append(pages[:count])
        pages = pages[count:]
    batch = RaggedBatch.build([([1] * new, cached, table) for (new, cached), table in zip(rows, tables)], page_size)
    num_pages, tokens = 4 + sum(needed), batch.num_tokens
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return batch, dict(
        q=normal(tokens, heads, dim), k=normal(tokens, kv_heads, dim), v=normal(tokens, kv_heads, dim),
        kv_pages=normal(2, num_pages, page_size, 2 * kv_heads, dim),
        index_q=normal(tokens, index_heads, index_dim), index_k=normal(tokens, index_dim),
        index_pages=normal(3, num_pages, page_size, index_dim),
    )


def _select(fn, batch, data, **options):
    return fn(data["index_q"], data["index_k"], data["index_pages"], batch.page_indices[0], slot=jnp.int32(2),
              token_seq_ids=batch.seq_ids, token_positions=batch.positions, slot_mapping=batch.slot_mapping[0],
              kv_lens=batch.kv_lens, cu_q_lens=batch.cu_q_lens, **options)


def _attend(fn, batch, data, selected, **options):
    return fn(data["q"], data["k"], data["v"], data["kv_pages"], batch.page_indices[0], selected, slot=jnp.int32(1),
              token_seq_ids=batch.seq_ids, token_positions=batch.positions, slot_mapping=batch.slot_mapping[0],
              **options)


def _compare(rows, *, page_size=4, heads=4, kv_heads=2, index_heads=2, dim=16, index_dim=8, block_size=4,
             topk_blocks=3, local_blocks=1, seed=0, dtype=jnp.float32, atol=2e-5, score_options=None):
    batch, data = _step(rows, page_size=page_size, heads=heads, kv_heads=kv_heads, index_heads=index_heads,
                        dim=dim, index_dim=index_dim, seed=seed, dtype=dtype)
    select_options = dict(block_size=block_size, topk_blocks=topk_blocks, local_blocks=local_blocks)
    want_selected, want_index = jax.jit(functools.partial(_select, index_select_blocks, **select_options))(batch, data)
    kernel = functools.partial(_select, index_select_blocks_kernel, interpret=True, score_options=score_options,
                               **select_options)
    got_selected, got_index = jax.jit(kernel)(batch, data)
    real = int(batch.cu_q_lens[-1])
    np.testing.assert_array_equal(np.asarray(got_index), np.asarray(want_index))
    np.testing.assert_array_equal(np.asarray(got_selected[:real]), np.asarray(want_selected[:real]))
    assert (np.asarray(got_selected[real:]) == -1).all(), "padding tokens select nothing"

    attend_options = dict(sm_scale=dim**-0.5, block_size=block_size)
    want_out, want_pages = jax.jit(functools.partial(_attend, block_sparse_attention, **attend_options))(
        batch, data, want_selected)
    got_out, got_pages = jax.jit(functools.partial(_attend, block_sparse_attention_kernel, interpret=True,
                                                   **attend_options))(batch, data, want_selected)
    np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))
    np.testing.assert_allclose(np.asarray(got_out[:real], np.float32), np.asarray(want_out[:real], np.float32),
                               atol=atol, rtol=atol)


MIXED_ROWS = [(1, 9), (7, 0), (1, 30), (12, 5), (1, 0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_match_the_references_on_a_mixed_batch(seed):
    _compare(MIXED_ROWS, seed=seed)


@pytest.mark.parametrize("block_size,score_options", [
    (2, dict(kv_block=16)), (16, dict(kv_block=16)), (32, dict(kv_block=16, query_rows=16)), (8, dict(kv_block=32)),
], ids=["block2", "block16", "block32_two_tiles", "block8_tile32"])
def test_block_sizes_below_and_above_the_key_tile(block_size, score_options):
    _compare([(1, 70), (40, 3), (1, 0), (3, 90)], block_size=block_size, topk_blocks=3, seed=block_size,
             score_options=score_options)


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_kernels_cross_page_boundaries(page_size):
    _compare([(3, page_size - 1 if page_size > 1 else 4), (1, 2 * page_size), (5, 3 * page_size + 1)],
             page_size=page_size, seed=page_size)


def test_top_k_larger_than_the_context_pads_with_minus_one():
    _compare([(1, 2), (6, 0), (1, 9)], block_size=4, topk_blocks=8, local_blocks=2, seed=3)


@pytest.mark.parametrize("local_blocks", [0, 3])
def test_local_block_forcing(local_blocks):
    _compare(MIXED_ROWS, local_blocks=local_blocks, topk_blocks=4, seed=4)


# One KV head under four query heads and one index head (4, 1, 1): the 500-token case below.
@pytest.mark.parametrize("heads,kv_heads,index_heads", [(8, 2, 4), (6, 3, 1), (3, 1, 3)])
def test_head_layouts(heads, kv_heads, index_heads):
    _compare(MIXED_ROWS, heads=heads, kv_heads=kv_heads, index_heads=index_heads, seed=heads + kv_heads)


def test_kernels_in_bfloat16_stay_within_bfloat16_rounding():
    batch, data = _step(MIXED_ROWS, page_size=4, heads=4, kv_heads=2, index_heads=2, dim=16, index_dim=8, seed=5,
                        dtype=jnp.bfloat16)
    options = dict(block_size=4, topk_blocks=3, local_blocks=1)
    selected, _ = jax.jit(functools.partial(_select, index_select_blocks, **options))(batch, data)
    attend = functools.partial(_attend, sm_scale=0.25, block_size=4)
    want, _ = jax.jit(functools.partial(attend, block_sparse_attention))(batch, data, selected)
    got, _ = jax.jit(functools.partial(attend, block_sparse_attention_kernel, interpret=True))(batch, data, selected)
    real = int(batch.cu_q_lens[-1])
    np.testing.assert_allclose(np.asarray(got[:real], np.float32), np.asarray(want[:real], np.float32), atol=3e-2)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_on_decodes_beside_a_500_token_prefill_chunk(seed):
    _compare([(1, 40), (500, 37), (1, 1), (1, 130), (3, 0)], page_size=16, block_size=16, topk_blocks=4,
             heads=4, kv_heads=1, index_heads=1, seed=seed, score_options=dict(kv_block=16))


def test_a_block_size_that_is_not_a_power_of_two_is_refused():
    batch, data = _step([(2, 1)], page_size=4, heads=4, kv_heads=2, index_heads=2, dim=16, index_dim=8, seed=0)
    with pytest.raises(KernelShapeError, match="block_size=6"):
        _select(index_select_blocks_kernel, batch, data, block_size=6, topk_blocks=2, local_blocks=1,
                interpret=True)
