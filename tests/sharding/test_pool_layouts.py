"""The pool of bytes (agentjax/kv/layout.py) under TP and DCP: each device holds its part of every slab
(`local_layout`), and greedy tokens and raw values equal one device's pool, bit for bit in
batch-invariant numerics, for a recurrent-state model, a sliding-window model and a dense model."""
from __future__ import annotations

import pytest

from tests.sharding.parity import assert_same_run, greedy_run, need_devices


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout", [
    ("tiny-kimi-k3", dict(tensor_parallel_size=2)),
    ("tiny-sliding", dict(tensor_parallel_size=2)),
    ("tiny-dense", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
])
def test_a_pool_under_a_parallel_layout_gives_one_devices_tokens(preset, layout):
    need_devices(8)
    single = greedy_run(preset, "batch_invariant", kv_layout="pool")
    assert_same_run(single, greedy_run(preset, "batch_invariant", kv_layout="pool", **layout), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-sliding", "tiny-kimi-k3"])
def test_an_fp8_kv_pool_under_tp2_gives_one_devices_fp8_tokens(preset):
    """FP8 K/V rows split by KV head (and MLA latent rows replicated) over two devices: each row keeps its
    own scale, so the tokens and raw values equal one device's FP8 pool bit for bit."""
    need_devices(8)
    single = greedy_run(preset, "batch_invariant", kv_layout="pool", kv_cache_dtype="fp8")
    assert_same_run(single, greedy_run(preset, "batch_invariant", kv_layout="pool", kv_cache_dtype="fp8",
                                       tensor_parallel_size=2), exact=True)
