"""The verification step's premise, in `numerics="batch_invariant"`: a decode row that carries k draft
tokens as extra query tokens computes, for each of them, exactly the logits a one-token decode of that
token would (the attention and matmuls there are blocked per token row), on every tiny preset whose
KV speculative decoding supports; and a batch built with `sample_counts` samples each row's last tokens."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from agentjax.ragged_batch import RaggedBatch

PAGE = 16


@functools.lru_cache(maxsize=None)
def _model(name: str):
    from agentjax.models import load_model

    return load_model(f"preset:{name}")


def _logits_in_pieces(name: str, prompt: list[int], continuation: list[int], pieces: list[int]) -> np.ndarray:
    """Logits of every continuation token when the continuation runs in steps of `pieces` tokens."""
    from agentjax.runner.step import make_step

    cfg, params, _ = _model(name)
    step = make_step(cfg, "batch_invariant", all_positions=True)
    kv = cfg.new_kv_pages(16, PAGE)
    total = len(prompt) + len(continuation)
    table = list(range(1, 1 + -(-total // PAGE)))
    tables = [table] * len(kv)
    _, kv = step(params, kv, RaggedBatch.build([(prompt, 0, tables)], PAGE))
    out, start = [], len(prompt)
    for size in pieces:
        piece, continuation = continuation[:size], continuation[size:]
        logits, kv = step(params, kv, RaggedBatch.build([(piece, start, tables)], PAGE))
        out.append(np.asarray(logits[:size]))
        start += size
    return np.concatenate(out)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "tiny-dense" else (pytest.mark.slow,))
                                  for n in ("tiny-dense", "tiny-sliding", "tiny-minimax-m3", "tiny-dsv4")])
def test_draft_tokens_as_extra_query_rows_give_the_one_token_decode_logits(name):
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(300, 3000, 37)]
    continuation = [int(t) for t in rng.integers(300, 3000, 6)]
    one_at_a_time = _logits_in_pieces(name, prompt, continuation, [1] * 6)
    with_drafts = _logits_in_pieces(name, prompt, continuation, [6])  # the real token and 5 drafts
    split = _logits_in_pieces(name, prompt, continuation, [2, 4])
    assert np.array_equal(with_drafts, one_at_a_time)
    assert np.array_equal(split, one_at_a_time)


def test_sample_counts_sample_each_rows_last_tokens_row_after_row():
    rows = [([5, 6, 7], 10, [1]), ([8], 3, [2]), ([9, 10], 0, [3])]
    batch = RaggedBatch.build(rows, PAGE, sample_counts=[3, 1, 2])
    assert batch.num_samples == 8 and batch.num_seqs == 8
    assert batch.logits_indices[:6].tolist() == [0, 1, 2, 3, 4, 5]
    plain = RaggedBatch.build(rows, PAGE)
    assert plain.logits_indices[:3].tolist() == [2, 3, 5] and plain.num_samples == plain.num_seqs
    assert RaggedBatch.build(rows, PAGE, sample_counts=[1, 1, 1]).logits_indices.tolist() == \
        plain.logits_indices.tolist()
    wide = RaggedBatch.build([([1] * 6, 0, [1])] * 3, PAGE, sample_counts=[6, 6, 6])
    assert wide.num_samples == 32 and wide.logits_indices[12:18].tolist() == list(range(12, 18))
