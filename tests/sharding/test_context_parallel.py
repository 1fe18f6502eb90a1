"""Decode and prefill context parallelism (sharding/attention.py) on 8 virtual CPU devices: DCP (KV
interleaved over the DCP ranks token by token, effective page = page x dcp) and PCP (DualChunkSwap token
split, KV all-gathered) give the single-device greedy tokens, bit-equal raw logits and prompt log
probabilities in batch-invariant numerics, and close values in fast numerics (DCP's LSE merge)."""
from __future__ import annotations

import numpy as np
import pytest

from sharding.attention import pcp_token_split
from tests.sharding.parity import assert_same_run, greedy_run, need_devices


def test_dual_chunk_swap_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    cu_q_lens = np.array([0, 8, 11, 11], np.int32)  # rows of 8 and 3 tokens, then padding rows
    split = pcp_token_split(cu_q_lens, num_tokens=16, ranks=2)
    # row 0: chunks [0,1] [2,3] [4,5] [6,7] -> rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2
    assert split[0, :4].tolist() == [0, 1, 6, 7] and split[1, :4].tolist() == [2, 3, 4, 5]
    # row 1 (3 tokens in 4 chunks: [8] [9] [10] []) -> rank 0 takes 8 and nothing, rank 1 takes 9 and 10
    assert split[0, 4:5].tolist() == [8] and split[1, 4:6].tolist() == [9, 10]
    real = sorted(int(t) for t in split.ravel() if t < 16)
    assert real == list(range(11))  # every real token exactly once; the rest is padding (16)


DCP = [
    ("tiny-dense", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),  # DCP = TP
    ("tiny-dense", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-sliding", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),  # window 8 -> 4 per rank
    ("tiny-kimi-k3", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),  # MLA latent split, KDA state replicated
]
PCP = [
    ("tiny-dense", dict(prefill_context_parallel_size=4)),
    ("tiny-dense", dict(prefill_context_parallel_size=2, tensor_parallel_size=2)),
    ("tiny-sliding", dict(prefill_context_parallel_size=2)),
    ("tiny-minimax-m3", dict(prefill_context_parallel_size=4)),
    ("tiny-minimax-m3", dict(prefill_context_parallel_size=2, tensor_parallel_size=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout", DCP + PCP)
def test_context_parallel_is_bit_equal_to_one_device_in_batch_invariant_numerics(preset, layout):
    need_devices()
    assert_same_run(greedy_run(preset, "batch_invariant"), greedy_run(preset, "batch_invariant", **layout), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("preset, layout", [DCP[1], DCP[3], PCP[0], PCP[3]])
def test_context_parallel_fast_numerics_match_one_device_closely(preset, layout):
    need_devices()
    assert_same_run(greedy_run(preset, "fast"), greedy_run(preset, "fast", **layout), exact=False)


@pytest.mark.slow
def test_dcp_interleaves_the_kv_over_ranks_token_by_token():
    """After a prefill, DCP rank r's page p holds the tokens at offsets r, r+dcp, ... of the single-device
    effective page p: gathered back they equal one device's KV buffer bit for bit."""
    need_devices()
    from agentjax.models import load_model
    from agentjax.runner.model_runner import ModelRunner
    from agentjax.runner.sharded_runner import ShardedModelRunner
    from sharding.mesh import ParallelConfig

    cfg, params, _ = load_model("preset:tiny-dense")
    rows = [(list(range(3, 40)), 0, [[1, 2, 3]])]  # 37 tokens on effective pages of 16
    sampling = [(0.0, 0, 1.0, 0, 0)]
    single = ModelRunner(cfg, params, 8, 16, "batch_invariant")
    single.execute(rows, sampling)
    parallel = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    sharded = ShardedModelRunner(cfg, params, 8, 16, "batch_invariant", parallel=parallel)
    assert sharded.kv_pages[0].shape[3] == 8  # each rank's page holds 8 of the page's 16 tokens
    sharded.execute(rows, sampling)
    want = np.asarray(single.kv_pages[0])  # [layers, pages, 16, kv2, dim]
    got = np.asarray(sharded.kv_pages[0])  # [devices, layers, pages, 8, kv2, dim]; devices = (tensor=1, dcp=2)
    interleaved = np.stack([got[0], got[1]], axis=3).reshape(want.shape)  # offset o*2 + r <- rank r, offset o
    np.testing.assert_array_equal(interleaved, want)


@pytest.mark.slow
def test_kv_manager_and_scheduler_count_the_effective_page():
    need_devices()
    from agentjax import LLM

    llm = LLM("preset:tiny-dense", block_size=4, num_kv_blocks=32, tensor_parallel_size=4,
              decode_context_parallel_size=4)
    assert llm.engine.kv.block_size == 16 and llm.engine.runner.page_size == 16
    pool = llm.engine.runner.kv_pages  # the byte pool: a device's cell of a page holds its 4 of the 16 tokens
    assert llm.engine.kv.layout.mode == "pool" and pool.layout.kind(0).cell_shape[0] == 4
