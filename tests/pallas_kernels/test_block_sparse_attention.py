"""The block-sparse attention and indexer references against a dense numpy version of transformers'
MiniMaxM3VL indexer and masked attention, on random data fed in ragged chunked batches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.block_sparse_attention import block_sparse_attention, index_select_blocks

HEADS, KV_HEADS, DIM, INDEX_DIM = 4, 2, 8, 6


def _dense_selection(iq, ik, block, topk, local):
    """transformers' indexer on one whole sequence: `[index_heads, tokens, topk]` (-1 padded)."""
    n = iq.shape[0]
    scores = np.einsum("qhd,kd->hqk", iq.astype(np.float64), ik.astype(np.float64))
    scores = np.where(np.arange(n)[None, None, :] > np.arange(n)[None, :, None], -np.inf, scores)
    nblk = -(-n // block)
    scores = np.pad(scores, ((0, 0), (0, 0), (0, nblk * block - n)), constant_values=-np.inf)
    blk = scores.reshape(*scores.shape[:2], nblk, block).max(-1)
    for back in range(local):
        blk[:, np.arange(n), np.maximum(np.arange(n) // block - back, 0)] = np.inf
    kk = min(topk, nblk)
    order = np.argsort(-blk, axis=-1, kind="stable")[..., :kk]
    chosen = np.take_along_axis(blk, order, -1)
    return np.where(chosen == -np.inf, -1, order)


def _dense_attention(q, k, v, selection, block, scale):
    n, hq, _ = q.shape
    group_index = hq // selection.shape[0]
    keep = np.zeros((hq, n, n), bool)
    for h in range(hq):
        for t in range(n):
            for b in selection[h // group_index, t]:
                if b >= 0:
                    keep[h, t, b * block:(b + 1) * block] = True
    keep &= np.arange(n)[None, None, :] <= np.arange(n)[None, :, None]
    k, v = np.repeat(k, hq // k.shape[1], 1), np.repeat(v, hq // v.shape[1], 1)
    s = np.where(keep, np.einsum("qhd,khd->hqk", q, k) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


_select = jax.jit(index_select_blocks, static_argnames=("block_size", "topk_blocks", "local_blocks",
                                                        "batch_invariant"))
_attend = jax.jit(block_sparse_attention, static_argnames=("sm_scale", "block_size", "batch_invariant"))


def _run(seqs, chunk, page_size, block, topk, local, batch_invariant):
    """Feed each sequence in chunks of `chunk` tokens, all sequences side by side; returns each
    sequence's (selection [tokens, index_heads, topk], output [tokens, heads, dim])."""
    num_pages = 1 + sum(-(-len(s[0]) // page_size) for s in seqs)
    kv = jnp.zeros((2, num_pages, page_size, 2 * KV_HEADS, DIM), jnp.float32)
    index = jnp.zeros((3, num_pages, page_size, INDEX_DIM), jnp.float32)
    tables, next_page = [], 1
    for s in seqs:
        count = -(-len(s[0]) // page_size)
        tables.append(list(range(next_page, next_page + count)))
        next_page += count
    sel_out, att_out = [[] for _ in seqs], [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(done[i] < len(s[0]) for i, s in enumerate(seqs)):
        rows, parts = [], []
        for i, s in enumerate(seqs):
            if done[i] < len(s[0]):
                c = min(chunk, len(s[0]) - done[i])
                rows.append(([1] * c, done[i], tables[i]))
                parts.append((i, done[i], c))
        batch = RaggedBatch.build(rows, page_size)
        arrays = [np.zeros((batch.num_tokens, *x.shape[1:]), np.float32) for x in seqs[0]]
        pos = 0
        for i, start, c in parts:
            for a, x in zip(arrays, seqs[i]):
                a[pos:pos + c] = x[start:start + c]
            pos += c
        q, k, v, iq, ik = (jnp.asarray(a) for a in arrays)
        meta = dict(token_seq_ids=batch.seq_ids, token_positions=batch.positions,
                    slot_mapping=batch.slot_mapping[0], batch_invariant=batch_invariant)
        selected, index = _select(iq, ik, index, batch.page_indices[0], slot=1, block_size=block,
                                  topk_blocks=topk, local_blocks=local, **meta)
        out, kv = _attend(q, k, v, kv, batch.page_indices[0], selected, slot=1, sm_scale=DIM**-0.5,
                          block_size=block, **meta)
        pos = 0
        for i, start, c in parts:
            sel_out[i].append(np.asarray(selected)[pos:pos + c])
            att_out[i].append(np.asarray(out)[pos:pos + c])
            done[i] += c
            pos += c
    return [(np.concatenate(s), np.concatenate(o)) for s, o in zip(sel_out, att_out)]


def _sequences(lengths, index_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(HEADS, DIM), (KV_HEADS, DIM), (KV_HEADS, DIM), (index_heads, INDEX_DIM), (INDEX_DIM,)]
    return [tuple(rng.standard_normal((n, *shape)).astype(np.float32) for shape in shapes) for n in lengths]


def _same_set(ours, theirs):
    """Equal selections up to order: the attention reads the set of blocks."""
    return np.array_equal(np.sort(ours, -1), np.sort(theirs, -1))


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("chunk,page_size,block,topk,local", [
    (64, 4, 4, 2, 1),   # whole sequences, block = page
    (5, 4, 8, 3, 2),    # ragged chunks, a block spans two pages, two forced blocks
    (3, 16, 4, 2, 0),   # four blocks per page, nothing forced
])
def test_selection_and_attention_match_transformers_dense_math(batch_invariant, chunk, page_size, block, topk, local):
    seqs = _sequences((1, 9, 23, 41))
    for (q, k, v, iq, ik), (selected, out) in zip(seqs, _run(seqs, chunk, page_size, block, topk, local,
                                                             batch_invariant)):
        expected = _dense_selection(iq, ik, block, topk, local)  # [ih, n, kk]
        kk = expected.shape[-1]
        assert (selected[:, :, kk:] == -1).all()
        assert _same_set(selected[:, :, :kk], expected.transpose(1, 0, 2))
        np.testing.assert_allclose(out, _dense_attention(q, k, v, expected, block, DIM**-0.5), atol=2e-5, rtol=1e-5)


def test_the_indexer_really_drops_blocks_and_forces_the_local_one():
    (q, k, v, iq, ik), = seqs = _sequences((41,))
    (selected, _), = _run(seqs, 64, 4, 4, 2, 1, True)
    valid = (selected >= 0).sum(-1)
    assert valid.max() == 2 and (np.arange(41) // 4 + 1 > 2).sum() > 20  # most queries could see more blocks
    for t in range(41):
        assert (selected[t] == t // 4).any(-1).all()  # the query's own block, for every indexer head


@pytest.mark.parametrize("index_heads", [1, 4])
def test_index_heads_other_than_kv_heads_select_for_their_query_heads(index_heads):
    seqs = _sequences((30,), index_heads=index_heads, seed=3)
    (q, k, v, iq, ik), = seqs
    (selected, out), = _run(seqs, 7, 4, 4, 2, 1, False)
    expected = _dense_selection(iq, ik, 4, 2, 1)
    assert _same_set(selected, expected.transpose(1, 0, 2))
    np.testing.assert_allclose(out, _dense_attention(q, k, v, expected, 4, DIM**-0.5), atol=2e-5, rtol=1e-5)


def test_batch_invariant_results_do_not_depend_on_chunking_or_neighbours():
    seqs = _sequences((37, 12, 29), seed=5)
    alone = _run(seqs[:1], 64, 4, 4, 2, 1, True)[0]
    for chunk in (1, 5, 16):
        mixed = _run(seqs, chunk, 4, 4, 2, 1, True)[0]
        assert np.array_equal(mixed[0], alone[0])
        assert np.array_equal(mixed[1], alone[1]), f"chunk {chunk}"
