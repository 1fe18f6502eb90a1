"""Tests of pallas_kernels/ragged_work.py: work items cover each real token once; split-KV partials merge
into the attention over all keys."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_work import merge_attention_partials, next_power_of_two, work_items


def test_next_power_of_two():
    assert [next_power_of_two(v) for v in (0, 1, 2, 3, 16, 17, 100)] == [1, 1, 2, 4, 16, 32, 128]


def test_work_items_cover_every_real_token_once():
    cu_q_lens = jnp.array([0, 1, 9, 9, 30, 30, 30], jnp.int32)
    seq, start, count = map(np.asarray, jax.jit(work_items, static_argnums=(1, 2))(cu_q_lens, 32, 4))
    covered = np.zeros(32, int)
    for s, a, c in zip(seq, start, count):
        covered[a:a + c] += 1
        if c:
            assert cu_q_lens[s] <= a and a + c <= cu_q_lens[s + 1]
    np.testing.assert_array_equal(covered, (np.arange(32) < 30).astype(int))


def test_merge_of_split_partials_equals_attention_over_all_keys():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 10))
    values = rng.standard_normal((10, 4))
    parts = [slice(0, 4), slice(4, 4), slice(4, 10)]
    outs, lses = [], []
    for part in parts:
        s = scores[:, part]
        if s.shape[1] == 0:
            outs.append(np.zeros((3, 4)))
            lses.append(np.full(3, -np.inf))
            continue
        weights = np.exp(s - s.max(1, keepdims=True))
        outs.append(weights @ values[part] / weights.sum(1, keepdims=True))
        lses.append(np.log(np.exp(s).sum(1)))
    out, lse = jax.jit(merge_attention_partials)(jnp.asarray(np.stack(outs)[:, :, None], jnp.float32),
                                        jnp.asarray(np.stack(lses)[:, :, None], jnp.float32))
    full = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out)[:, 0], full @ values, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[:, 0], np.log(np.exp(scores).sum(1)), atol=1e-5)
