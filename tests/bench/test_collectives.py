"""Collectives per step: agentjax/bench/hlo_collectives.py reads them from a lowered step (loop trip counts
included), and for every layout on the tiny presets they equal the shape formula of
agentjax/bench/collective_formulas.py, in fast and batch-invariant numerics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from agentjax.kv.cache_layout import kv_buffer_specs
from agentjax.models.presets import FULL_SIZE_PRESETS, PRESETS
from sharding.attention import pcp_token_split
from agentjax.bench.collective_formulas import expected_collectives
from agentjax.bench.hlo_collectives import collectives_of, tensor_bytes
from sharding.mesh import ParallelConfig, build_mesh
from tests.sharding.parity import need_devices


def test_tensor_bytes_reads_mlir_types():
    assert tensor_bytes("64x2x16xf32") == 64 * 2 * 16 * 4 and tensor_bytes("8xbf16") == 16 and tensor_bytes("i32") == 4


def test_collectives_in_a_loop_count_once_per_iteration():
    need_devices(4)
    mesh = build_mesh(ParallelConfig(tensor_parallel_size=4))

    def per_device(x):
        x = jax.lax.fori_loop(0, 3, lambda i, acc: jax.lax.psum(acc, ("tensor", "dcp")) * 0.5, x)
        return jax.lax.all_gather(x, ("tensor", "dcp"), axis=0, tiled=True)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=PartitionSpec(("tensor", "dcp")),
                           out_specs=PartitionSpec(), check_vma=False)
    stats = collectives_of(jax.jit(mapped).lower(jnp.zeros((8, 5), jnp.float32)).as_text())
    assert stats.counts == {"all_reduce": 3, "all_gather": 1}
    assert stats.bytes == {"all_reduce": 3 * 2 * 5 * 4, "all_gather": 8 * 5 * 4}


TP, DEP = dict(tensor_parallel_size=4), dict(data_parallel_size=8, enable_expert_parallel=True)
CASES = [
    ("tiny-dense", TP), ("tiny-dense", DEP), ("tiny-dense", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-dense", dict(prefill_context_parallel_size=2, tensor_parallel_size=2)),
    ("tiny-sliding", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-minimax-m3", TP), ("tiny-minimax-m3", DEP), ("tiny-minimax-m3", dict(prefill_context_parallel_size=4)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2)), ("tiny-kimi-k3", dict(data_parallel_size=4, enable_expert_parallel=True)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),
    ("tiny-dsv4", dict(tensor_parallel_size=2)), ("tiny-dsv4", DEP),
]


def _cases_quick_first() -> list:
    """Every case; beyond tiny-dense's, a preset's later layouts are marked slow (lowering a sharded
    step takes seconds even with every executable cached), so the quick tier keeps one per preset."""
    seen, params = set(), []
    for preset, layout in CASES:
        quick = preset == "tiny-dense" or preset not in seen
        seen.add(preset)
        params.append(pytest.param(preset, layout, marks=() if quick else (pytest.mark.slow,)))
    return params


@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
@pytest.mark.parametrize("preset, layout", _cases_quick_first())
def test_lowered_step_runs_the_collectives_the_formula_says(preset, layout, numerics):
    need_devices()
    from agentjax.runner.sharded_step import lowered_step_text

    cfg, parallel = PRESETS[preset], ParallelConfig(**layout)
    groups = len(kv_buffer_specs(cfg, 16))
    rows = [(list(range(3, 40)), 0, [[1, 2, 3]] * groups), (list(range(5, 14)), 0, [[4]] * groups)]  # 46 -> 64 tokens
    read = collectives_of(lowered_step_text(cfg, parallel, numerics, [rows] * parallel.data_parallel_size,
                                            page_size=16))
    pcp_tokens = None
    if parallel.prefill_context_parallel_size > 1:
        pcp_tokens = pcp_token_split(np.array([0, 37, 46] + [46] * 7), 64, parallel.prefill_context_parallel_size).shape[1]
    assert read == expected_collectives(cfg, parallel, numerics, tokens=64, rows=8, pages=8, page_size=16,
                                        pcp_tokens=pcp_tokens)
    if cfg.moe is not None or parallel.data_parallel_size == 1:
        assert read.counts  # only DP of a dense model runs without collectives


def test_formula_scales_with_the_full_size_shapes():
    cfg = FULL_SIZE_PRESETS["minimax-m3"]
    tp8 = expected_collectives(cfg, ParallelConfig(tensor_parallel_size=8), "fast", tokens=64, rows=64)
    # 60 attention outputs + 3 dense MLPs + 57 x (experts + shared experts), each [64 tokens, 6144] bf16
    assert tp8.counts == {"all_reduce": 60 + 3 + 57 * 2}
    assert tp8.bytes["all_reduce"] == (60 + 3 + 57 * 2) * 64 * 6144 * 2
    dep8 = expected_collectives(cfg, ParallelConfig(data_parallel_size=8, enable_expert_parallel=True), "fast",
                                tokens=64, rows=64)
    assert dep8.counts == {"all_to_all": 57 * 4}
