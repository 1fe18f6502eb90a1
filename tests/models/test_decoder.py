"""agentjax/models/decoder.py and decoder_block.py: bucket padding reaches no expert. A decode step of
tiny-minimax-m3 with 5 real rows in an 8-row bucket sends 5 rows' tokens to every MoE layer's experts (counted
in the MoE op), and the real rows' hidden states are bit for bit those of the same step with its padding routed
as before."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentjax.models import decoder_block
from agentjax.models.params import random_params, split_model
from agentjax.models.presets import preset_config
from agentjax.ragged_batch import RaggedBatch

PAGE = 16
PROMPTS = ([1, 5, 9, 200, 31, 77], [7, 7, 300, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5], [100, 200], [11, 22, 33])


def _forward_with_stats(cfg, numerics):
    graphdef, _ = split_model(cfg)

    @jax.jit
    def forward(params, kv, batch):
        return nnx.merge(graphdef, params).forward_with_stats(kv, batch, numerics)

    return forward


def _decode_step(cfg, numerics):
    """Prefill the five prompts, then one decode step of their five rows; returns the decode step's
    `(hidden of the real rows, routed pairs per layer, the batch)`."""
    params = random_params(cfg)
    kv = tuple(cfg.new_kv_pages(32, PAGE))
    forward = _forward_with_stats(cfg, numerics)
    tables = [[1 + 2 * row, 2 + 2 * row] for row in range(len(PROMPTS))]
    prefill = RaggedBatch.build([(p, 0, t) for p, t in zip(PROMPTS, tables)], PAGE)
    _, kv, _ = forward(params, kv, prefill)
    decode = RaggedBatch.build([([9], len(p), t) for p, t in zip(PROMPTS, tables)], PAGE)
    hidden, _, routed = forward(params, kv, decode)
    return np.asarray(hidden)[: len(PROMPTS)], np.asarray(routed), decode


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
def test_a_decode_step_sends_only_its_real_rows_to_the_experts(numerics, monkeypatch):
    cfg = preset_config("tiny-minimax-m3")
    hidden, routed, batch = _decode_step(cfg, numerics)
    assert batch.num_tokens == 8 and batch.num_seqs == 8  # 5 real rows in an 8-row bucket
    k = cfg.moe.num_experts_per_token
    moe_layers = [i for i, kind in enumerate(cfg.mlp_layer_types) if kind in ("moe", "hash_moe")]
    assert moe_layers and len(routed) == cfg.num_layers
    assert [int(routed[i]) for i in moe_layers] == [5 * k] * len(moe_layers)
    assert all(int(routed[i]) == 0 for i in range(cfg.num_layers) if i not in moe_layers)

    # The same step with every token taken as real (padding routed to experts, as before): 8 rows'
    # pairs reach the experts and the real rows' hidden states do not change by a bit.
    monkeypatch.setattr(decoder_block, "real_token_mask", lambda b: jnp.ones(b.token_ids.shape, bool))
    padded_hidden, padded_routed, _ = _decode_step(cfg, numerics)
    assert [int(padded_routed[i]) for i in moe_layers] == [8 * k] * len(moe_layers)
    np.testing.assert_array_equal(hidden, padded_hidden)


def test_real_token_mask_marks_each_rows_new_tokens_and_not_the_padding():
    rows = [([4, 5, 6], 0, [1]), ([7], 20, [2, 3]), ([8, 9], 3, [4])]
    batch = RaggedBatch.build(rows, PAGE)
    mask = np.asarray(decoder_block.real_token_mask(batch))
    assert batch.num_tokens == 8
    assert mask.tolist() == [True] * 6 + [False] * 2


def test_real_token_mask_finds_padding_that_sits_in_a_real_row():
    """Eight rows fill the row bucket, so the padding tokens carry row 7's id; their position 0 lies
    outside row 7's new tokens (positions 5-7), so they are padding all the same."""
    rows = [([t], 5 + t, [1 + t]) for t in range(7)] + [([1, 2, 3], 5, [9])]
    batch = RaggedBatch.build(rows, PAGE)
    mask = np.asarray(decoder_block.real_token_mask(batch))
    assert batch.num_tokens == 16 and batch.num_seqs == 8
    assert mask.tolist() == [True] * 10 + [False] * 6
