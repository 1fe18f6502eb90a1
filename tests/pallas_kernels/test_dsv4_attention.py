"""The DeepSeek-V4 paged references (pallas_kernels/dsv4_attention.py) on hand-built pages: the
indexer's tie rule and causal padding, the first CSA block's pool, and attention that reads only the
query's window and ended entries (everything else in the pages is NaN), over many HCA chunks."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dsv4_attention as ops


def _paged(rows: np.ndarray, per_page: int, page_order: np.ndarray, num_pages: int) -> np.ndarray:
    """`[1, num_pages, per_page, width]` pages (NaN where unused) holding `rows` in table order."""
    pages = np.full((1, num_pages, per_page, rows.shape[1]), np.nan, np.float32)
    for j, page in enumerate(page_order):
        chunk = rows[j * per_page:(j + 1) * per_page]
        pages[0, page, :len(chunk)] = chunk
    return pages


def test_indexer_keeps_the_top_k_ended_entries_ties_to_the_lower_entry_and_pads_with_minus_one():
    ratio, per_page, num_entries = 4, 2, 8
    # one head, key = score: entries 1, 3 and 6 tie at 5.0, entry 7 scores highest but ends late
    scores = np.array([1.0, 5.0, 2.0, 5.0, 0.5, 3.0, 5.0, 9.0], np.float32)
    keys = np.zeros((num_entries, 2), np.float32)
    keys[:, 0] = scores
    order = np.array([5, 2, 7, 1])
    pages = jnp.asarray(_paged(keys, per_page, order, 9))
    q = jnp.asarray(np.tile([[[1.0, 0.0]]], (4, 1, 1)), jnp.float32)  # relu(q . key) = score
    weights = jnp.ones((4, 1), jnp.float32)
    positions = jnp.asarray([31, 27, 7, 2], jnp.int32)  # 8, 7, 2 and 0 entries have ended
    chosen = ops.indexer_topk(q, weights, pages, jnp.int32(0), jnp.asarray(order[None], jnp.int32),
                              token_seq_ids=jnp.zeros(4, jnp.int32), token_positions=positions, ratio=ratio,
                              topk=3, sm_scale=1.0)
    assert np.asarray(chosen).tolist() == [[7, 1, 3], [1, 3, 6], [1, 0, -1], [-1, -1, -1]]


@pytest.mark.parametrize("overlap", [True, False])
def test_pool_takes_the_previous_blocks_first_half_and_this_blocks_second_half(overlap):
    ratio, dim, page_size = 4, 3, 8
    c = 2 if overlap else 1
    rng = np.random.default_rng(0)
    state = rng.normal(size=(24, 2 * c * dim)).astype(np.float32)
    bias = rng.normal(size=(ratio, c * dim)).astype(np.float32)
    order = np.array([3, 1, 2])
    pages = jnp.asarray(_paged(state, page_size, order, 4))
    ends = np.array([3, 7, 23])
    pooled = ops.pool_blocks(pages, jnp.int32(0), jnp.asarray(np.tile(order, (3, 1)), jnp.int32),
                             jnp.asarray(ends, jnp.int32), jnp.asarray(bias), ratio=ratio, overlap=overlap)
    for i, end in enumerate(ends):
        block = slice(end + 1 - ratio, end + 1)
        kv, gate = state[block, :c * dim], state[block, c * dim:] + bias
        if overlap:
            kv, gate = kv[:, dim:], gate[:, dim:]
            if end + 1 > ratio:  # the previous block's first halves join, with their own biases
                previous = slice(end + 1 - 2 * ratio, end + 1 - ratio)
                kv = np.concatenate([state[previous, :dim], kv])
                gate = np.concatenate([state[previous, c * dim:c * dim + dim] + bias[:, :dim], gate])
        weights = np.exp(gate - gate.max(0))
        expected = (kv * weights / weights.sum(0)).sum(0)
        np.testing.assert_allclose(np.asarray(pooled[i]), expected, rtol=1e-5, atol=1e-6)


def _expected_attention(q, keys, sinks, scale):
    logits = q @ keys.T * scale
    top = np.maximum(logits.max(1), sinks)
    weights = np.exp(logits - top[:, None])
    return weights @ keys / (weights.sum(1) + np.exp(sinks - top))[:, None]


@pytest.mark.parametrize("mode", ["window only", "selected", "dense over many chunks"])
def test_attention_reads_only_the_window_and_ended_entries(mode):
    """Pages hold NaN everywhere a query must not look: before its window, past its position, and in
    entries whose block has not ended (or that the indexer did not pick)."""
    heads, dim, page_size, window, ratio = 2, 4, 4, 6, 2
    per_page = page_size // ratio
    rng = np.random.default_rng(1)
    length = 160  # 80 entries: more than one 64-entry chunk of the dense path
    rows = rng.normal(size=(length, dim)).astype(np.float32)
    entries = rng.normal(size=(length // ratio, dim)).astype(np.float32)
    num_pages = length // page_size
    order = rng.permutation(np.arange(1, num_pages + 1))
    entry_order = rng.permutation(np.arange(1, num_pages + 1))
    positions = np.array([0, 5, 77, 159])
    q = rng.normal(size=(4, heads, dim)).astype(np.float32)
    sinks = np.array([0.3, -0.7], np.float32)
    chosen = np.array([[-1, -1], [1, -1], [38, 3], [79, 10]], np.int32)
    for t, pos in enumerate(positions):  # one query per run: what it may not read becomes NaN
        seen_rows = rows[max(0, pos - window + 1):pos + 1]
        ended = (pos + 1) // ratio
        poisoned_rows = rows.copy()
        poisoned_rows[:max(0, pos - window + 1)] = np.nan
        poisoned_rows[pos + 1:] = np.nan
        poisoned_entries = entries.copy()
        if mode == "selected":
            picked = [c for c in chosen[t] if c >= 0]
            keys = np.concatenate([seen_rows, entries[picked]])
            keep = np.zeros(len(entries), bool)
            keep[picked] = True
            poisoned_entries[~keep] = np.nan
        elif mode == "dense over many chunks":
            keys = np.concatenate([seen_rows, entries[:ended]])
            poisoned_entries[ended:] = np.nan
        else:
            keys = seen_rows
        extra = {}
        if mode != "window only":
            extra = dict(entry_pages=jnp.asarray(_paged(poisoned_entries, per_page, entry_order, num_pages + 1)),
                         entry_slot=jnp.int32(0), entry_page_indices=jnp.asarray(entry_order[None], jnp.int32),
                         ratio=ratio)
            if mode == "selected":
                extra["selected"] = jnp.asarray(chosen[t:t + 1])
        out = ops.sliding_compressed_attention(
            jnp.asarray(q[t:t + 1]), jnp.asarray(_paged(poisoned_rows, page_size, order, num_pages + 1)),
            jnp.int32(0), jnp.asarray(order[None], jnp.int32), jnp.asarray(sinks),
            token_seq_ids=jnp.zeros(1, jnp.int32), token_positions=jnp.asarray([pos], jnp.int32), window=window,
            sm_scale=dim ** -0.5, **extra)
        np.testing.assert_allclose(np.asarray(out[0]), _expected_attention(q[t], keys, sinks, dim ** -0.5),
                                   rtol=1e-5, atol=1e-6)
