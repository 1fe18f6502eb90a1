"""States saved inside a prefill chunk (pallas_kernels/kda_states.py through `state_saves`): the page of
a checkpoint holds what a run that stops there keeps in its running page (bit for bit when
batch-invariant), on the reference, the chunked form and the kernel op (interpret mode on a CPU).
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.ragged_batch import RaggedBatch
from pallas_kernels import kda_kernels

sys.path.insert(0, str(Path(__file__).parent))
from test_kda import DIM, HEADS, NUM_PAGES, _conv_weight, _op, _pages, _run, _sequence  # noqa: E402


def _checkpoint_step(pages, seq, other, weight, *, batch_invariant, op=_op):
    """Row 0 (state page 2) runs tokens [10, 60) with checkpoints at 16, 32 and 48 into pages 4, 0 (the null
    page: no save) and 5; row 1 (page 7) runs 9 tokens from 3 beside it."""
    rows = [([0] * 50, 10, [[2, 4, 0, 5]]), ([0] * 9, 3, [[7]])]
    batch = RaggedBatch.build(rows, 16, state_groups=(0,), state_interval=16)
    inputs = {name: np.zeros((batch.num_tokens, *seq[name].shape[1:]), np.float32) for name in seq}
    for name in inputs:
        inputs[name][:50], inputs[name][50:59] = seq[name][10:60], other[name][3:12]
    table = batch.page_indices[0]
    rows_of = batch.seq_ids[np.clip(batch.state_save_tokens, 0, batch.num_tokens - 1)]
    save_pages = np.where(batch.state_save_cols > 0, table[rows_of, batch.state_save_cols], NUM_PAGES)
    return op(inputs["mixed"], inputs["g"], inputs["beta"], weight, pages, batch.cu_q_lens, batch.kv_lens,
              table[:, 0], slot=jnp.int32(0), token_seq_ids=batch.seq_ids, num_heads=HEADS, head_dim=DIM,
              batch_invariant=batch_invariant, state_saves=(batch.state_save_tokens, save_pages))[1], batch


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_checkpoints_inside_a_chunk_hold_the_state_a_run_ending_there_keeps(batch_invariant):
    seq, other, weight = _sequence(50, 60), _sequence(51, 12), _conv_weight()
    _, pages = _run(_pages(), [[(0, 10), (1, 3)]], [seq, other], [2, 7], weight, batch_invariant=batch_invariant)
    saved, batch = _checkpoint_step(pages, seq, other, weight, batch_invariant=batch_invariant)
    # only the boundaries whose column names a page are saved, at the flat index of token boundary - 1
    assert batch.state_save_tokens[:2].tolist() == [5, 37] and batch.state_save_cols[:2].tolist() == [1, 3]
    for boundary, page in ((16, 4), (48, 5)):
        _, stopped = _run(pages, [[(0, boundary - 10)]], [seq], [2], weight, batch_invariant=batch_invariant,
                          done=[10])
        if batch_invariant:
            np.testing.assert_array_equal(np.asarray(saved[0, page]), np.asarray(stopped[0, 2]))
        else:
            np.testing.assert_allclose(np.asarray(saved[0, page]), np.asarray(stopped[0, 2]), atol=1e-5, rtol=1e-5)
    _, whole = _run(pages, [[(0, 50), (1, 9)]], [seq, other], [2, 7], weight, batch_invariant=batch_invariant,
                    done=[10, 3])
    np.testing.assert_array_equal(np.asarray(saved[:, [2, 7]]), np.asarray(whole[:, [2, 7]]))  # running pages
    untouched = [p for p in range(1, NUM_PAGES) if p not in (2, 4, 5, 7)]
    np.testing.assert_array_equal(np.asarray(saved[:, untouched]), np.asarray(pages[:, untouched]))


def test_the_kernel_op_saves_checkpoints_through_the_reference():
    seq, other, weight = _sequence(52, 60), _sequence(53, 12), _conv_weight()
    _, pages = _run(_pages(), [[(0, 10), (1, 3)]], [seq, other], [2, 7], weight, batch_invariant=False)
    kernel_op = jax.jit(kda_kernels.kimi_delta_attention_kernel,
                        static_argnames=("num_heads", "head_dim", "batch_invariant", "chunk_size", "interpret"))
    reference, _ = _checkpoint_step(pages, seq, other, weight, batch_invariant=False)
    kernel, _ = _checkpoint_step(pages, seq, other, weight, batch_invariant=False,
                                 op=lambda *a, **k: kernel_op(*a, interpret=True, **k))
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), atol=1e-6, rtol=1e-6)
    assert not np.array_equal(np.asarray(kernel[0, 4]), np.asarray(pages[0, 4]))


def test_no_checkpoint_is_saved_without_an_interval_or_for_decode_rows():
    rows = [([0] * 50, 10, [[2, 4, 0, 5]]), ([0], 31, [[7, 8]])]
    assert (RaggedBatch.build(rows, 16, state_groups=(0,)).state_save_cols == 0).all()
    batch = RaggedBatch.build(rows, 16, state_groups=(0,), state_interval=16)
    assert (batch.state_save_cols > 0).sum() == 2 and len(batch.state_save_tokens) == 8
