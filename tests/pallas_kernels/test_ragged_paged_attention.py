"""The ragged paged attention reference against dense causal attention, on random data."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.ragged_batch import RaggedBatch
from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def _dense(q, k, v, scale, window):
    n, hq, _ = q.shape
    hk = k.shape[1]
    k, v = np.repeat(k, hq // hk, 1), np.repeat(v, hq // hk, 1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    mask = (j <= i) & ((j > i - window) if window else True)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


_attention = jax.jit(
    ragged_paged_attention, static_argnames=("layer", "sm_scale", "sliding_window", "batch_invariant")
)


def _run(seqs, chunks, page_size, window, hq=4, hk=2, dim=8, batch_invariant=False):
    """Feed each sequence's q/k/v in the given chunk sizes; return outputs in token order."""
    num_pages = 1 + sum(-(-len(s[0]) // page_size) for s in seqs)
    kv = jnp.zeros((1, num_pages, page_size, 2 * hk, dim), jnp.float32)
    tables, next_page = [], 1
    for q, _, _ in seqs:
        n = -(-len(q) // page_size)
        tables.append(list(range(next_page, next_page + n)))
        next_page += n
    outs = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(done[i] < len(s[0]) for i, s in enumerate(seqs)):
        rows, parts = [], []
        for i, (q, k, v) in enumerate(seqs):
            if done[i] < len(q):
                c = min(chunks, len(q) - done[i])
                rows.append(([1] * c, done[i], tables[i]))
                parts.append((i, done[i], c))
        batch = RaggedBatch.build(rows, page_size)
        T = batch.num_tokens
        qs, ks, vs = (np.zeros((T, h, dim), np.float32) for h in (hq, hk, hk))
        pos = 0
        for i, start, c in parts:
            qs[pos : pos + c], ks[pos : pos + c], vs[pos : pos + c] = (x[start : start + c] for x in seqs[i])
            pos += c
        out, kv = _attention(
            jnp.asarray(qs), jnp.asarray(ks), jnp.asarray(vs), kv, batch.kv_lens, batch.page_indices[0],
            batch.cu_q_lens, layer=0, token_seq_ids=batch.seq_ids, token_positions=batch.positions,
            slot_mapping=batch.slot_mapping[0], sm_scale=dim**-0.5, sliding_window=window,
            batch_invariant=batch_invariant,
        )
        out = np.asarray(out)
        pos = 0
        for i, start, c in parts:
            outs[i].append(out[pos : pos + c])
            done[i] += c
            pos += c
    return [np.concatenate(o) for o in outs]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_matches_dense_causal_attention_for_ragged_chunked_batches(window, chunk, batch_invariant):
    rng = np.random.default_rng(0)
    seqs = [tuple(rng.standard_normal((n, h, 8)).astype(np.float32) for h in (4, 2, 2)) for n in (1, 7, 19, 33)]
    outs = _run(seqs, chunk, page_size=4, window=window, batch_invariant=batch_invariant)
    for (q, k, v), out in zip(seqs, outs):
        np.testing.assert_allclose(out, _dense(q, k, v, 8**-0.5, window), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_batch_invariant_chunking_does_not_change_any_output_bit(window):
    rng = np.random.default_rng(1)
    seqs = [tuple(rng.standard_normal((n, h, 8)).astype(np.float32) for h in (4, 2, 2)) for n in (11, 30)]
    whole = _run(seqs, 64, page_size=4, window=window, batch_invariant=True)
    chunked = _run(seqs, 7, page_size=4, window=window, batch_invariant=True)
    alone = _run(seqs[1:], 64, page_size=4, window=window, batch_invariant=True)
    np.testing.assert_array_equal(alone[0], whole[1])
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)


def test_soft_cap_sinks_and_lse_match_a_dense_float64_softmax():
    rng = np.random.default_rng(2)
    n, hq, hk, dim, page_size, cap, window = 13, 4, 2, 8, 4, 1.5, 6
    q, k, v = (rng.standard_normal((n, h, dim)).astype(np.float32) for h in (hq, hk, hk))
    sinks = rng.standard_normal(hq).astype(np.float32)
    batch = RaggedBatch.build([([1] * n, 0, [1, 2, 3, 4])], page_size)
    kv = jnp.zeros((1, 5, page_size, 2 * hk, dim), jnp.float32)
    pad = batch.num_tokens - n
    padded = [jnp.asarray(np.pad(x, ((0, pad), (0, 0), (0, 0)))) for x in (q, k, v)]
    attention = jax.jit(functools.partial(ragged_paged_attention, layer=0, sm_scale=dim**-0.5, sliding_window=window,
                                          soft_cap=cap, return_lse=True))
    out, _, lse = attention(
        *padded, kv, batch.kv_lens, batch.page_indices[0], batch.cu_q_lens, token_seq_ids=batch.seq_ids,
        token_positions=batch.positions, slot_mapping=batch.slot_mapping[0], sinks=jnp.asarray(sinks),
    )
    kr, vr = np.repeat(k, hq // hk, 1).astype(np.float64), np.repeat(v, hq // hk, 1).astype(np.float64)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kr) * dim**-0.5
    s = cap * np.tanh(s / cap)
    i, j = np.arange(n)[:, None], np.arange(n)[None]
    s = np.where((j <= i) & (j > i - window), s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(sinks[:, None, None], (hq, n, 1))], axis=-1)
    weights = np.exp(s - s.max(-1, keepdims=True))
    probs = weights / weights.sum(-1, keepdims=True)
    want = np.einsum("hqk,khd->qhd", probs[..., :n], vr)
    want_lse = np.log(np.exp(s).sum(-1)).T
    np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse[:n]), want_lse, atol=2e-5, rtol=1e-5)
