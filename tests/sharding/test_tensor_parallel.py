"""Tensor parallelism on 8 virtual CPU devices: each tiny preset under TP gives the single-device greedy
tokens, and in batch-invariant numerics bit-equal raw logits and prompt log probabilities, through `LLM`
(dense GQA, GQA with KV heads repeated over ranks, sliding windows, MiniMax-M3's block-sparse layers
and MoE, Kimi-K3's KDA, MLA and latent MoE, DeepSeek-V4's compressed attention, mHC and hash-routed MoE)."""
from __future__ import annotations

import pytest

from tests.sharding.parity import assert_same_run, greedy_run, need_devices

LAYOUTS = [
    ("tiny-dense", 2),
    ("tiny-dense", 4),  # 2 KV heads over 4 ranks: each head on two ranks
    ("tiny-sliding", 4),  # 1 KV head, sliding windows, Gemma norms
    ("tiny-minimax-m3", 4),  # indexer heads repeated like KV heads, MoE experts' columns split
    ("tiny-kimi-k3", 2),  # KDA heads and state, MLA heads, latent MoE
    ("tiny-dsv4", 2),  # DeepSeek-V4: heads, sinks and output groups split; K=V rows, compressors, indexer shared
]


@pytest.mark.slow
@pytest.mark.parametrize("preset, tp", LAYOUTS)
def test_tensor_parallel_is_bit_equal_to_one_device_in_batch_invariant_numerics(preset, tp):
    need_devices()
    single = greedy_run(preset, "batch_invariant")
    assert_same_run(single, greedy_run(preset, "batch_invariant", tensor_parallel_size=tp), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("preset, tp", [("tiny-dense", 4), ("tiny-kimi-k3", 2), ("tiny-minimax-m3", 2)])
def test_tensor_parallel_fast_numerics_match_one_device_closely(preset, tp):
    need_devices()
    assert_same_run(greedy_run(preset, "fast"), greedy_run(preset, "fast", tensor_parallel_size=tp), exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout", [
    ("tiny-minimax-m3", dict(tensor_parallel_size=2, enable_expert_parallel=True)),  # experts over the TP ranks
    ("tiny-kimi-k3", dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)),  # EP = DP x TP
])
def test_expert_parallel_inside_tensor_parallel_is_bit_equal_to_one_device(preset, layout):
    need_devices()
    single = greedy_run(preset, "batch_invariant")
    assert_same_run(single, greedy_run(preset, "batch_invariant", **layout), exact=True)
