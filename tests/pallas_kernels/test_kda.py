"""The KDA reference op (pallas_kernels/kda.py) against a float64 numpy KDA, and its exactness contract.

Rows run through `RaggedBatch.build` with a state group (each row's table is its running state page), in
steps of given sizes, so the state really travels through the pages between steps.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.ragged_batch import RaggedBatch
from pallas_kernels import kda
from pallas_kernels.kda_recurrence import state_size

sys.path.insert(0, str(Path(__file__).parent))
from kda_numpy_reference import kda_core  # noqa: E402

HEADS, DIM, KERNEL = 2, 8, 4
CHANNELS = 3 * HEADS * DIM
SIZE = state_size(HEADS, DIM, KERNEL)
NUM_PAGES = 12

_op = jax.jit(kda.kimi_delta_attention, static_argnames=("num_heads", "head_dim", "batch_invariant", "chunk_size"))


def _sequence(seed: int, length: int, kernel: int = KERNEL) -> dict:
    """Random op inputs for one sequence; per-step decays exp(g) span ~0.01 .. 0.999 (as in the fixtures)."""
    rng = np.random.default_rng(seed)
    return dict(
        mixed=rng.normal(size=(length, CHANNELS)).astype(np.float32),
        g=(-np.exp(rng.uniform(np.log(1e-3), np.log(4.6), size=(length, HEADS, DIM)))).astype(np.float32),
        beta=rng.uniform(size=(length, HEADS)).astype(np.float32),
    )


def _conv_weight(seed: int = 99, kernel: int = KERNEL) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(CHANNELS, kernel)) * 0.5).astype(np.float32)


def _run(pages, steps, seqs, state_pages, weight, *, batch_invariant, slot=0, done=None):
    """Run `steps` (each a list of `(sequence index, new tokens)`) in order; returns `(outputs per
    sequence, pages)`. `state_pages[i]` is sequence i's running state page; `done[i]` its start."""
    done = list(done or [0] * len(seqs))
    outs = [[] for _ in seqs]
    for step in steps:
        rows = [([0] * count, done[i], [state_pages[i]]) for i, count in step]
        batch = RaggedBatch.build(rows, 16, state_groups=(0,))
        inputs = {name: np.zeros((batch.num_tokens, *seqs[0][name].shape[1:]), np.float32) for name in seqs[0]}
        at = 0
        for i, count in step:
            for name in inputs:
                inputs[name][at:at + count] = seqs[i][name][done[i]:done[i] + count]
            at += count
        out, pages = _op(inputs["mixed"], inputs["g"], inputs["beta"], weight, pages, batch.cu_q_lens, batch.kv_lens,
                         batch.page_indices[0][:, 0], slot=jnp.int32(slot), token_seq_ids=batch.seq_ids,
                         num_heads=HEADS, head_dim=DIM, batch_invariant=batch_invariant)
        out = np.asarray(out)
        at = 0
        for i, count in step:
            outs[i].append(out[at:at + count])
            done[i] += count
            at += count
    return [np.concatenate(o) if o else np.zeros((0, HEADS, DIM)) for o in outs], pages


def _pages(num_slots: int = 1) -> jax.Array:
    return jnp.zeros((num_slots, NUM_PAGES, SIZE), jnp.float32)


def _in_chunks(index: int, length: int, chunk: int) -> list[list[tuple[int, int]]]:
    return [[(index, min(chunk, length - start))] for start in range(0, length, chunk)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_one_row_matches_the_numpy_recurrence_and_its_page_holds_state_then_conv_tail(batch_invariant):
    seq, weight = _sequence(0, 45), _conv_weight()
    (out,), pages = _run(_pages(), [[(0, 45)]], [seq], [3], weight, batch_invariant=batch_invariant)
    ref_out, ref_state, ref_tail = kda_core(seq["mixed"], seq["g"], seq["beta"], weight, HEADS, DIM)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    page = np.asarray(pages[0, 3])
    split = HEADS * DIM * DIM
    np.testing.assert_allclose(page[:split].reshape(HEADS, DIM, DIM), ref_state, atol=1e-5, rtol=1e-5)
    # The tail is the last K-1 raw projections (oldest first), copied exactly.
    np.testing.assert_array_equal(page[split:].reshape(KERNEL - 1, CHANNELS), seq["mixed"][-(KERNEL - 1):])


def test_a_prompt_shorter_than_the_conv_keeps_zeros_before_its_start_in_the_tail():
    seq, weight = _sequence(1, 2), _conv_weight()
    (out,), pages = _run(_pages(), [[(0, 2)]], [seq], [3], weight, batch_invariant=True)
    tail = np.asarray(pages[0, 3, HEADS * DIM * DIM:]).reshape(KERNEL - 1, CHANNELS)
    np.testing.assert_array_equal(tail, np.concatenate([np.zeros((1, CHANNELS)), seq["mixed"]]))
    np.testing.assert_allclose(out, kda_core(seq["mixed"], seq["g"], seq["beta"], weight, HEADS, DIM)[0], atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_row_in_chunks_equals_the_row_whole_through_its_state_page(chunk, batch_invariant):
    seq, weight = _sequence(2, 40), _conv_weight()
    (whole,), whole_pages = _run(_pages(), [[(0, 40)]], [seq], [5], weight, batch_invariant=batch_invariant)
    (split,), split_pages = _run(_pages(), _in_chunks(0, 40, chunk), [seq], [5], weight,
                                 batch_invariant=batch_invariant)
    if batch_invariant:
        np.testing.assert_array_equal(split, whole)
        np.testing.assert_array_equal(np.asarray(split_pages), np.asarray(whole_pages))
    else:
        np.testing.assert_allclose(split, whole, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(split_pages), np.asarray(whole_pages), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_ragged_rows_together_equal_each_row_alone(batch_invariant):
    """Three rows share steps (a prefill beside another row's chunk and a decode), then eight more
    rows join (a wider row bucket); each row alone, in the same chunks, gives the same bits."""
    lengths = [5, 37, 1, 20, 3, 9, 2, 11, 6, 1, 4]
    seqs = [_sequence(10 + i, n) for i, n in enumerate(lengths)]
    weight = _conv_weight()
    steps = [[(0, 5), (1, 16), (2, 1)], [(1, 16), (3, 7)], [(1, 5), (3, 13)] + [(i, lengths[i]) for i in range(4, 11)]]
    together, _ = _run(_pages(), steps, seqs, list(range(1, 12)), weight, batch_invariant=batch_invariant)
    for i in range(len(seqs)):
        alone_steps = [[(i, n) for j, n in step if j == i] for step in steps]
        alone, _ = _run(_pages(), [s for s in alone_steps if s], seqs, list(range(1, 12)), weight,
                        batch_invariant=batch_invariant)
        if batch_invariant:
            np.testing.assert_array_equal(together[i], alone[i])
        else:
            np.testing.assert_allclose(together[i], alone[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_row_resumes_from_its_state_copied_to_another_page(batch_invariant):
    """What a prefix hit does: the state saved after 32 tokens is copied into a fresh running page
    (the old page then recycled and overwritten) and the row continues from there."""
    seq, weight = _sequence(3, 50), _conv_weight()
    (whole,), whole_pages = _run(_pages(), [[(0, 32)], [(0, 18)]], [seq], [4], weight, batch_invariant=batch_invariant)
    (first,), pages = _run(_pages(), [[(0, 32)]], [seq], [4], weight, batch_invariant=batch_invariant)
    pages = pages.at[:, 9].set(pages[:, 4]).at[:, 4].set(jnp.nan)
    (rest,), pages = _run(pages, [[(0, 18)]], [seq], [9], weight, batch_invariant=batch_invariant, done=[32])
    resumed = np.concatenate([first, rest])
    if batch_invariant:
        np.testing.assert_array_equal(resumed, whole)
        np.testing.assert_array_equal(np.asarray(pages[:, 9]), np.asarray(whole_pages[:, 4]))
    else:
        np.testing.assert_allclose(resumed, whole, atol=1e-5, rtol=1e-5)
    ref = kda_core(seq["mixed"], seq["g"], seq["beta"], weight, HEADS, DIM)[0]
    np.testing.assert_allclose(resumed, ref, atol=1e-5, rtol=1e-5)


def test_a_row_starting_at_zero_ignores_what_its_recycled_page_holds():
    seq, weight = _sequence(4, 20), _conv_weight()
    (clean,), _ = _run(_pages(), [[(0, 20)]], [seq], [2], weight, batch_invariant=True)
    dirty = _pages().at[:, 2].set(jnp.nan)
    (out,), _ = _run(dirty, [[(0, 20)]], [seq], [2], weight, batch_invariant=True)
    np.testing.assert_array_equal(out, clean)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_padding_rows_and_tokens_leave_every_other_page_untouched(batch_invariant):
    """Two rows in an 8-row bucket (six padding rows on page 0), in slot 1 of a 2-slot buffer: every
    other (slot, page), the null page included, keeps its bytes."""
    seqs = [_sequence(20, 7), _sequence(21, 3)]
    garbage = jnp.asarray(np.random.default_rng(5).normal(size=(2, NUM_PAGES, SIZE)), jnp.float32)
    _, pages = _run(garbage, [[(0, 7), (1, 3)]], seqs, [6, 8], _conv_weight(), batch_invariant=batch_invariant, slot=1)
    changed = np.argwhere(np.any(np.asarray(pages) != np.asarray(garbage), axis=-1))
    assert sorted(map(tuple, changed.tolist())) == [(1, 6), (1, 8)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_padding_tokens_of_a_full_row_bucket_do_not_touch_its_last_row(batch_invariant):
    """With 8 rows in an 8-row bucket the padding tokens carry seq id 7, a real row; it still equals
    the row run alone."""
    seqs = [_sequence(30 + i, 2 + i) for i in range(8)]
    weight = _conv_weight()
    together, _ = _run(_pages(), [[(i, 2 + i) for i in range(8)]], seqs, list(range(1, 9)), weight,
                       batch_invariant=batch_invariant)
    alone, _ = _run(_pages(), [[(7, 9)]], seqs, list(range(1, 9)), weight, batch_invariant=batch_invariant)
    np.testing.assert_allclose(together[7], alone[7], atol=0 if batch_invariant else 1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_form_equals_the_recurrence_on_ragged_rows(chunk_size, strong_decay):
    """Rows of 1, 31, 32, 33 and 70 tokens from nonzero states: the chunked form (chunks aligned to each
    row) equals the token-sequential recurrence; strong decay drives exp(g) down to ~2e-9 per step."""
    rng = np.random.default_rng(6)
    lengths = [1, 31, 32, 33, 70]
    total, rows = sum(lengths), 8
    cu = np.full(rows + 1, total, np.int32)
    cu[:len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
    seq_ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    normed = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = normed(rng.normal(size=(total, HEADS, DIM))) * DIM ** -0.5
    k = normed(rng.normal(size=(total, HEADS, DIM)))
    v = rng.normal(size=(total, HEADS, DIM))
    high = np.log(20.0) if strong_decay else np.log(0.05)
    g = -np.exp(rng.uniform(np.log(1e-4), high, size=(total, HEADS, DIM)))
    beta = rng.uniform(size=(total, HEADS))
    states = rng.normal(size=(rows, HEADS, DIM, DIM)) * 0.3
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, states)]
    chunked, chunked_states, _ = kda.chunked_delta_rule(*args, jnp.asarray(cu), chunk_size)
    recurrent, recurrent_states, _ = kda.recurrent_delta_rule(*args, jnp.asarray(seq_ids), total)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(recurrent), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked_states), np.asarray(recurrent_states), atol=1e-5, rtol=1e-5)


def test_op_under_jit_equals_eager_and_compiles_once_per_shape():
    seq, weight = _sequence(7, 24), _conv_weight()
    batch = RaggedBatch.build([([0] * 24, 0, [3])], 16, state_groups=(0,))
    pad = lambda x: np.pad(x, [(0, batch.num_tokens - 24)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    args = (pad(seq["mixed"]), pad(seq["g"]), pad(seq["beta"]), weight)
    meta = (batch.cu_q_lens, batch.kv_lens, batch.page_indices[0][:, 0])
    kwargs = dict(token_seq_ids=batch.seq_ids, num_heads=HEADS, head_dim=DIM)
    eager, eager_pages = kda.kimi_delta_attention(*args, _pages(2), *meta, slot=1, **kwargs)
    def step(*args, **kwargs):  # its own function, so its own compilation cache
        return kda.kimi_delta_attention(*args, **kwargs)

    jitted = jax.jit(step, static_argnames=("num_heads", "head_dim", "batch_invariant", "chunk_size"))
    out, pages = jitted(*args, _pages(2), *meta, slot=jnp.int32(1), **kwargs)
    jitted(*args, _pages(2), *meta, slot=jnp.int32(0), **kwargs)  # another slot: same compiled code
    assert jitted._cache_size() == 1
    np.testing.assert_allclose(np.asarray(out), np.asarray(eager), atol=1e-6)
    np.testing.assert_allclose(np.asarray(pages), np.asarray(eager_pages), atol=1e-6)
    assert np.all(np.asarray(out)[24:] == 0)  # padding tokens get zeros


def test_conv_width_three_matches_the_reference_across_chunks():
    """Kimi-Linear fixture b uses a width-3 conv: a 2-entry tail carried through 1-token steps."""
    seq, weight = _sequence(8, 9, kernel=3), _conv_weight(kernel=3)
    size = state_size(HEADS, DIM, 3)
    pages = jnp.zeros((1, NUM_PAGES, size), jnp.float32)
    done, outs = 0, []
    for count in (4, 1, 1, 3):
        batch = RaggedBatch.build([([0] * count, done, [2])], 16, state_groups=(0,))
        pad = lambda x: np.pad(x[done:done + count], [(0, batch.num_tokens - count)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        out, pages = _op(pad(seq["mixed"]), pad(seq["g"]), pad(seq["beta"]), weight, pages, batch.cu_q_lens,
                         batch.kv_lens, batch.page_indices[0][:, 0], slot=jnp.int32(0), token_seq_ids=batch.seq_ids,
                         num_heads=HEADS, head_dim=DIM, batch_invariant=True)
        outs.append(np.asarray(out)[:count])
        done += count
    ref = kda_core(seq["mixed"], seq["g"], seq["beta"], weight, HEADS, DIM)[0]
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_row_with_draft_tokens_saves_the_state_after_each_of_them(batch_invariant):
    """Speculative decoding: after 20 tokens a row runs a real token and 3 drafts in one step, saving the
    state after each into its own page (`draft_states`); page i then holds what the row's page holds after
    running its tokens one at a time up to draft i (the batch-invariant path: bit for bit), page 0 being
    its running page. A second row beside it, without drafts, saves nothing extra."""
    seq, other, weight = _sequence(40, 24), _sequence(41, 9), _conv_weight()
    _, pages = _run(_pages(), [[(0, 20), (1, 5)]], [seq, other], [2, 7], weight, batch_invariant=batch_invariant)
    stepwise = []
    for count in range(1, 5):
        _, after = _run(pages, [[(0, count)]], [seq], [2], weight, batch_invariant=batch_invariant, done=[20])
        stepwise.append(np.asarray(after[0, 2]))
    rows = [([0] * 4, 20, [[2, 9, 10, 11]]), ([0] * 4, 5, [[7]])]
    batch = RaggedBatch.build(rows, 16, state_groups=(0,), sample_counts=[4, 1])
    inputs = {name: np.zeros((batch.num_tokens, *seq[name].shape[1:]), np.float32) for name in seq}
    for name in inputs:
        inputs[name][:4], inputs[name][4:8] = seq[name][20:24], other[name][5:9]
    samples = batch.logits_indices
    save = np.full(batch.num_samples, NUM_PAGES, np.int32)
    save[:4] = [2, 9, 10, 11]
    rows_of = np.where(batch.sample_offsets >= 0, batch.seq_ids[samples], 0)
    _, saved = _op(inputs["mixed"], inputs["g"], inputs["beta"], weight, pages, batch.cu_q_lens, batch.kv_lens,
                   batch.page_indices[0][:, 0], slot=jnp.int32(0), token_seq_ids=batch.seq_ids, num_heads=HEADS,
                   head_dim=DIM, batch_invariant=batch_invariant, draft_states=(samples, rows_of, save))
    for index, page in enumerate([2, 9, 10, 11]):
        if batch_invariant:
            np.testing.assert_array_equal(np.asarray(saved[0, page]), stepwise[index])
        else:
            np.testing.assert_allclose(np.asarray(saved[0, page]), stepwise[index], atol=1e-5, rtol=1e-5)
    untouched = [p for p in range(NUM_PAGES) if p not in (2, 7, 9, 10, 11)]
    np.testing.assert_array_equal(np.asarray(saved[:, untouched]), np.asarray(pages[:, untouched]))
