"""DeepSeek-V4's lightning indexer kernels (scores, top-k) and its sliding + compressed attention kernel
against the jnp references (pallas_kernels/dsv4_attention.py), in interpret mode: mixed batches of
1-token decodes and prefill chunks (one of 500 tokens), page boundaries (one entry per page up to
several), top-k larger than the ended entries, exact score ties, head layouts, bfloat16, and pages
that hold NaN wherever a token must not read."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from agentjax.ragged_batch import RaggedBatch
from pallas_kernels import dsv4_attention as reference
from pallas_kernels import dsv4_attention_kernels as attention
from pallas_kernels import dsv4_indexer_kernels as indexer

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _step(rows, *, page_size, ratio, seed, heads=4, index_heads=2, dim=16, index_dim=8, dtype=jnp.float32):
    """A batch of `rows` = [(new tokens, tokens cached)] with shuffled window and entry pages (two
    KV groups, two tables) whose every row a token may not read is NaN."""
    rng = np.random.default_rng(seed)
    needed = [-(-(new + cached) // page_size) for new, cached in rows]
    num_pages = 3 + sum(needed)
    tables = []
    for _ in range(2):
        pages = rng.permutation(np.arange(1, num_pages)).tolist()
        tables.append([pages[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(rows))])
    batch = RaggedBatch.build([([1] * new, cached, [tables[0][i], tables[1][i]])
                               for i, (new, cached) in enumerate(rows)], page_size)
    per_page = page_size // ratio
    window = np.full((2, num_pages, page_size, dim), np.nan, np.float32)
    entries = np.full((3, num_pages, per_page, dim), np.nan, np.float32)
    keys = np.full((2, num_pages, per_page, index_dim), np.nan, np.float32)
    for i, (new, cached) in enumerate(rows):  # what each row has written: its tokens' rows and ended entries
        length = new + cached
        for position in range(length):
            window[1, tables[0][i][position // page_size], position % page_size] = rng.standard_normal(dim)
        for entry in range(length // ratio):
            page, row = tables[1][i][entry // per_page], entry % per_page
            entries[2, page, row] = rng.standard_normal(dim)
            keys[1, page, row] = rng.standard_normal(index_dim)
    tokens = batch.num_tokens
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return batch, dict(
        q=normal(tokens, heads, dim), index_q=normal(tokens, index_heads, index_dim),
        weights=jnp.asarray(rng.standard_normal((tokens, index_heads)), jnp.float32),
        window_pages=jnp.asarray(window, dtype), entry_pages=jnp.asarray(entries, dtype),
        key_pages=jnp.asarray(keys, dtype), sinks=jnp.asarray(rng.standard_normal(heads), jnp.float32))


def _select(fn, batch, data, **options):
    return fn(data["index_q"], data["weights"], data["key_pages"], jnp.int32(1), batch.page_indices[1],
              token_seq_ids=batch.seq_ids, token_positions=batch.positions, **options)


def _attend(fn, batch, data, mode, selected, *, ratio, window, **options):
    extra = {}
    if mode != "window":
        extra = dict(entry_pages=data["entry_pages"], entry_slot=jnp.int32(2), entry_page_indices=batch.page_indices[1],
                     ratio=ratio, selected=selected if mode == "selected" else None)
    return fn(data["q"], data["window_pages"], jnp.int32(1), batch.page_indices[0], data["sinks"],
              token_seq_ids=batch.seq_ids, token_positions=batch.positions, window=window,
              sm_scale=data["q"].shape[-1] ** -0.5, **extra, **options)


def _compare(rows, *, page_size=8, ratio=4, topk=3, window=6, seed=0, dtype=jnp.float32, atol=2e-5,
             score_options=None, attend_options=None, batch_invariant=False, modes=("window", "selected", "dense"),
             **shapes):
    batch, data = _step(rows, page_size=page_size, ratio=ratio, seed=seed, dtype=dtype, **shapes)
    real = int(batch.cu_q_lens[-1])
    options = dict(ratio=ratio, topk=topk, sm_scale=0.3, batch_invariant=batch_invariant)
    want_selected = jax.jit(functools.partial(_select, reference.indexer_topk, **options))(batch, data)
    got_selected = jax.jit(functools.partial(_select, indexer.indexer_topk_kernel, interpret=True,
                                             score_options=score_options, **options))(batch, data)
    np.testing.assert_array_equal(np.asarray(got_selected[:real]), np.asarray(want_selected[:real]))
    for mode in modes:
        common = dict(ratio=ratio, window=window, batch_invariant=batch_invariant)
        want = jax.jit(functools.partial(_attend, reference.sliding_compressed_attention, mode=mode, **common))(
            batch, data, selected=want_selected)
        got = jax.jit(functools.partial(_attend, attention.sliding_compressed_attention_kernel, mode=mode,
                                        interpret=True, **common, **(attend_options or {})))(
            batch, data, selected=want_selected)
        assert np.isfinite(np.asarray(got[:real], np.float32)).all(), f"{mode}: a NaN row was read"
        np.testing.assert_allclose(np.asarray(got[:real], np.float32), np.asarray(want[:real], np.float32),
                                   atol=atol, rtol=atol, err_msg=mode)
    return want_selected[:real]


MIXED_ROWS = [(1, 9), (7, 0), (1, 30), (12, 5), (1, 0), (1, 63)]


@pytest.mark.parametrize("seed", [0, 1])
def test_kernels_match_the_references_on_a_mixed_batch(seed):
    selected = _compare(MIXED_ROWS, seed=seed)
    assert (np.asarray(selected) >= 0).sum() > 20, "the batch exercises the selection"


@pytest.mark.parametrize("page_size,ratio", [(4, 4), (16, 4), (32, 16)],
                         ids=["one_entry_per_page", "four_per_page", "hca_rate_16"])
def test_kernels_cross_page_boundaries(page_size, ratio):
    # The "selected" and "dense" modes read the window pages as "window" does, and the entry pages too.
    _compare([(3, page_size - 1), (1, 2 * page_size), (5, 3 * page_size + 1), (1, 5 * page_size - 1)],
             page_size=page_size, ratio=ratio, topk=4, seed=page_size + ratio, modes=("selected", "dense"))


def test_top_k_larger_than_the_ended_entries_pads_with_minus_one():
    # Only the "selected" mode reads the selection (the -1 padding included).
    selected = np.asarray(_compare([(1, 2), (6, 0), (1, 21), (2, 40)], topk=20, seed=3, modes=("selected",)))
    assert (selected == -1).any() and (selected >= 0).any()


def test_score_ties_go_to_the_lower_entry_as_in_the_reference():
    batch, data = _step([(1, 40), (3, 30)], page_size=8, ratio=4, seed=4)
    # Row 0's query scores no key above zero (every score 0.0, some -0.0: weights of both signs);
    # row 1's ended entries all hold one key (every score equal).
    q = np.asarray(data["index_q"]).copy()
    q[0] = 0.0
    keys = np.asarray(data["key_pages"]).copy()
    table = np.asarray(batch.page_indices[1][1])
    for entry in range(8):
        keys[1, table[entry // 2], entry % 2] = keys[1, table[0], 0]
    data = dict(data, index_q=jnp.asarray(q), key_pages=jnp.asarray(keys))
    options = dict(ratio=4, topk=5, sm_scale=0.3)
    want = jax.jit(functools.partial(_select, reference.indexer_topk, **options))(batch, data)
    got = jax.jit(functools.partial(_select, indexer.indexer_topk_kernel, interpret=True, **options))(batch, data)
    assert np.asarray(want[:4]).tolist() == [[0, 1, 2, 3, 4]] * 4
    np.testing.assert_array_equal(np.asarray(got[:4]), np.asarray(want[:4]))


@pytest.mark.parametrize("heads,index_heads,attend_options,score_options", [
    (3, 1, None, None),
    (20, 3, dict(head_block=16), dict(query_rows=16)),
    (8, 16, dict(kv_block=16), dict(kv_block=16)),
], ids=["odd_heads", "two_head_tiles", "sixteen_index_heads_small_tiles"])
def test_head_layouts_and_tiles(heads, index_heads, attend_options, score_options):
    _compare(MIXED_ROWS, heads=heads, index_heads=index_heads, attend_options=attend_options,
             score_options=score_options, seed=heads, modes=("selected", "dense"))


def test_batch_invariant_numerics_score_one_token_per_work_item():
    _compare(MIXED_ROWS, batch_invariant=True, seed=6, modes=())


def test_kernels_in_bfloat16_stay_within_bfloat16_rounding():
    batch, data = _step(MIXED_ROWS, page_size=8, ratio=4, seed=7, dtype=jnp.bfloat16)
    selected = jax.jit(functools.partial(_select, reference.indexer_topk, ratio=4, topk=3, sm_scale=0.3))(batch, data)
    attend = functools.partial(_attend, mode="selected", ratio=4, window=6)
    want = jax.jit(functools.partial(attend, reference.sliding_compressed_attention))(batch, data, selected=selected)
    got = jax.jit(functools.partial(attend, attention.sliding_compressed_attention_kernel, interpret=True))(
        batch, data, selected=selected)
    real = int(batch.cu_q_lens[-1])
    np.testing.assert_allclose(np.asarray(got[:real], np.float32), np.asarray(want[:real], np.float32), atol=3e-2)


def test_kernels_on_decodes_beside_a_500_token_prefill_chunk():
    _compare([(1, 40), (500, 37), (1, 1), (1, 130), (3, 0)], page_size=16, ratio=4, topk=16, window=16, seed=8,
             score_options=dict(kv_block=64), attend_options=dict(kv_block=16))


def test_work_items_follow_runs_of_one_sequence():
    start, count = jax.jit(indexer.seq_runs, static_argnums=1)(
        jnp.asarray([0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3, 3], jnp.int32), 2)
    items = [(int(s), int(c)) for s, c in zip(start, count) if c > 0]
    assert items == [(0, 2), (2, 1), (3, 1), (4, 2), (6, 2), (8, 1), (9, 2), (11, 1)]


def test_a_tile_that_is_not_a_power_of_two_is_refused():
    batch, data = _step([(2, 1)], page_size=8, ratio=4, seed=0)
    with pytest.raises(KernelShapeError, match="kv_block=24"):
        _attend(attention.sliding_compressed_attention_kernel, batch, data, "window", None, ratio=4, window=6,
                kv_block=24, interpret=True)
