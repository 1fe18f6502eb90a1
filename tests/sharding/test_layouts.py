"""sharding/layouts.py: the rules table and the placements it derives (head repeats, gate|up interleave,
column maps, per-device shapes), and the per-device model of sharding/modules.py (host and abstract
shapes only, no step runs)."""
from __future__ import annotations

import numpy as np
import pytest

from agentjax.errors import ParallelLayoutError
from agentjax.models.presets import PRESETS
from sharding.layouts import LAYOUTS, layout_name, local_model_config, plan_parameter, plan_parameters
from sharding.mesh import ParallelConfig


def _plan(cfg, parallel, name, layout, shape, numerics="fast"):
    return plan_parameter(cfg, parallel, name, LAYOUTS[layout], shape, numerics)


def test_kv_heads_are_repeated_when_ranks_outnumber_them():
    cfg = PRESETS["tiny-dense"]  # 2 KV heads of 16
    plan = _plan(cfg, ParallelConfig(tensor_parallel_size=4), "k_proj", "kv_column", (64, 32))
    assert plan.placed_shape == (64, 64) and plan.local_shape == (64, 16) and plan.repeat == 2
    kernel = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    placed = plan.place(kernel)
    for rank in range(4):  # rank r holds KV head r // 2
        head = rank // 2
        np.testing.assert_array_equal(placed[:, rank * 16:(rank + 1) * 16], kernel[:, head * 16:(head + 1) * 16])
        assert plan.column_index[rank].tolist() == list(range(head * 16, head * 16 + 16))


def test_fused_gate_up_gives_each_rank_its_share_of_both_halves():
    cfg = PRESETS["tiny-minimax-m3"]
    plan = _plan(cfg, ParallelConfig(tensor_parallel_size=2), "gate_up", "fused_column", (8, 32, 128))
    kernel = np.arange(8 * 32 * 128, dtype=np.float32).reshape(8, 32, 128)
    placed = plan.place(kernel)
    gate, up = kernel[..., :64], kernel[..., 64:]
    for rank in range(2):
        local = placed[..., rank * 64:(rank + 1) * 64]
        np.testing.assert_array_equal(local[..., :32], gate[..., rank * 32:(rank + 1) * 32])
        np.testing.assert_array_equal(local[..., 32:], up[..., rank * 32:(rank + 1) * 32])
        np.testing.assert_array_equal(kernel[..., plan.column_index[rank]], local)


def test_row_layouts_split_the_output_in_batch_invariant_numerics():
    cfg = PRESETS["tiny-dense"]
    fast = _plan(cfg, ParallelConfig(tensor_parallel_size=4), "o_proj", "heads_row", (2, 64, 64))
    exact = _plan(cfg, ParallelConfig(tensor_parallel_size=4), "o_proj", "heads_row", (2, 64, 64), "batch_invariant")
    assert fast.local_shape == (2, 16, 64) and fast.spec[1] == ("tensor", "dcp")
    assert exact.local_shape == (2, 64, 16) and exact.spec[2] == ("tensor", "dcp")


def test_rules_pick_layouts_by_block_kind():
    cfg = PRESETS["tiny-kimi-k3"]
    tp = ParallelConfig(tensor_parallel_size=2)
    assert layout_name(cfg, tp, ("segments", 0, "blocks", 0, "attn", "q_proj", "kernel")) == "state_column"  # KDA
    assert layout_name(cfg, tp, ("segments", 0, "blocks", 3, "attn", "q_b_proj", "kernel")) == "heads_column"  # MLA
    assert layout_name(cfg, tp, ("segments", 0, "blocks", 3, "attn", "kv_a_proj_with_mqa", "kernel")) == "replicated"
    assert layout_name(cfg, tp, ("segments", 0, "blocks", 1, "mlp", "experts", "down_proj")) == "mlp_row"
    dep = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    assert layout_name(cfg, dep, ("segments", 0, "blocks", 1, "mlp", "experts", "down_proj")) == "experts"
    plans = plan_parameters(cfg, dep, "fast")  # DEP: attention is data parallel, so not split
    q_proj = plans[("segments", 0, "blocks", 1, "attn", "q_proj", "kernel")]
    assert q_proj.local_shape == q_proj.global_shape and set(q_proj.spec) == {None}


def test_local_config_divides_heads_and_widths():
    local = local_model_config(PRESETS["tiny-minimax-m3"], ParallelConfig(tensor_parallel_size=4))
    assert (local.num_heads, local.num_kv_heads, local.block_sparse.index_num_heads) == (1, 1, 1)
    assert local.moe.expert_intermediate_size == 16 and local.intermediate_size == 64
    kimi = local_model_config(PRESETS["tiny-kimi-k3"], ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2))
    assert kimi.num_heads == 1 and kimi.kda.num_heads == 2  # KDA state replicated over the DCP ranks


@pytest.mark.parametrize("preset, settings", [
    ("tiny-dense", dict(tensor_parallel_size=4)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2)),
    ("tiny-kimi-k3", dict(data_parallel_size=4, enable_expert_parallel=True)),
    ("tiny-minimax-m3", dict(tensor_parallel_size=4)),
])
@pytest.mark.parametrize("numerics", ["fast", "batch_invariant"])
def test_every_local_parameter_matches_its_layout(preset, settings, numerics):
    from sharding.modules import build_local_model

    graphdef, state, plans = build_local_model(PRESETS[preset], ParallelConfig(**settings), numerics)
    assert graphdef is not None and plans  # build_local_model raises on any disagreeing shape


def test_a_dimension_that_does_not_split_is_an_error():
    cfg = PRESETS["tiny-dense"]
    with pytest.raises(ParallelLayoutError, match="cannot be split over 4 ranks"):
        _plan(cfg, ParallelConfig(tensor_parallel_size=4), "w", "mlp_column", (64, 6))


def test_mtp_modules_are_left_out_of_the_step():
    plans = plan_parameters(PRESETS["tiny-minimax-m3"], ParallelConfig(tensor_parallel_size=2), "fast")
    assert not any(path[0] == "mtp" for path in plans)
