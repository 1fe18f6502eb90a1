"""sharding/mesh.py: the role table, vLLM's parallel settings, and the start-up errors of layouts that
do not fit the model or the devices (host only, no step runs)."""
from __future__ import annotations

import pytest

from agentjax.config import EngineConfig
from agentjax.errors import ParallelLayoutError
from agentjax.models.presets import FULL_SIZE_PRESETS, PRESETS
from sharding.mesh import MESH_AXES, ROLES, ParallelConfig, axes, build_mesh, check_layout


def test_every_role_names_mesh_axes_only():
    assert set(ROLES) >= {"data", "attn_dp", "expert", "tensor", "dcp", "pcp"}
    for role, role_axes in ROLES.items():
        assert role_axes and set(role_axes) <= set(MESH_AXES), role


def test_dcp_runs_inside_the_tensor_group():
    parallel = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    assert parallel.axis_sizes == {"data": 1, "pcp": 1, "tensor": 2, "dcp": 2}
    assert parallel.role_size("tensor") == 4 and parallel.role_size("kv_heads") == 2
    assert parallel.num_devices == 4 and parallel.kv_page_tokens(8) == 16
    assert parallel.name == "tp4-dcp2"


def test_expert_role_spans_data_and_tensor_ranks():
    parallel = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
    assert parallel.role_size("expert") == 4 and parallel.role_size("attn_dp") == 4
    assert parallel.name == "dep4"


def test_dcp_that_does_not_divide_tp_is_an_error():
    with pytest.raises(ParallelLayoutError, match="decode_context_parallel_size=3 must divide tensor_parallel_size=4"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=3)


def test_engine_config_takes_vllm_names_and_rejects_bad_sizes():
    cfg = EngineConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    assert cfg.parallel == ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ParallelLayoutError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="coordinator_address"):
        EngineConfig(num_processes=2)


def test_more_devices_than_exist_is_an_error():
    with pytest.raises(ParallelLayoutError, match="needs .* = 16 devices; 8 exist"):
        check_layout(PRESETS["tiny-dense"], ParallelConfig(tensor_parallel_size=4, data_parallel_size=4),
                     available_devices=8)


@pytest.mark.parametrize("preset, settings, message", [
    ("tiny-dense", dict(tensor_parallel_size=8), "num_heads=4 cannot be split over 8 ranks"),
    ("tiny-kimi-k3", dict(tensor_parallel_size=4), "num_heads=2 cannot be split over 4 ranks"),
    ("tiny-minimax-m3", dict(decode_context_parallel_size=2, tensor_parallel_size=2),
     "decode_context_parallel_size > 1 cannot run layer types block_sparse_attention"),
    ("tiny-kimi-k3", dict(prefill_context_parallel_size=2), "prefill_context_parallel_size > 1 cannot run layer "
                                                            "types kda"),
    ("tiny-kimi-k3", dict(data_parallel_size=3, enable_expert_parallel=True),
     "num_experts=8 cannot be split over the 3 expert-parallel ranks"),
    ("tiny-sliding", dict(tensor_parallel_size=4, decode_context_parallel_size=4),
     "decode_context_parallel_size=4 must divide sliding_window"),
    ("tiny-dsv4", dict(tensor_parallel_size=4), "compressed_attention o_groups=2 cannot be split over 4 ranks"),
])
def test_layout_that_does_not_fit_the_model_names_the_setting(preset, settings, message):
    cfg = PRESETS[preset]
    if preset == "tiny-sliding":
        cfg = cfg.replace(sliding_window=6)
    with pytest.raises(ParallelLayoutError, match=message):
        check_layout(cfg, ParallelConfig(**settings), available_devices=8)


def test_dcp_on_deepseek_v4_sparse_stack_is_refused():
    cfg = (PRESETS.get("tiny-dsv4") or FULL_SIZE_PRESETS.get("deepseek-v4-pro"))
    if cfg is None:
        pytest.skip("no DeepSeek-V4 preset in this tree")
    with pytest.raises(ParallelLayoutError, match="does not apply to DeepSeek-V4"):
        check_layout(cfg, ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2), available_devices=8)


@pytest.mark.parametrize("preset, settings", [
    ("tiny-dense", dict(tensor_parallel_size=4)),
    ("tiny-dense", dict(tensor_parallel_size=4, decode_context_parallel_size=2)),
    ("tiny-dense", dict(prefill_context_parallel_size=2, tensor_parallel_size=2)),
    ("tiny-kimi-k3", dict(tensor_parallel_size=2, decode_context_parallel_size=2)),
    ("tiny-kimi-k3", dict(data_parallel_size=8, enable_expert_parallel=True)),
    ("tiny-minimax-m3", dict(tensor_parallel_size=4)),
    ("tiny-minimax-m3", dict(prefill_context_parallel_size=4)),
    ("tiny-minimax-m3", dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)),
])
def test_layouts_the_tiny_presets_run_fit(preset, settings):
    check_layout(PRESETS[preset], ParallelConfig(**settings), available_devices=8)


def test_mesh_axes_have_the_layout_sizes():
    pytest.importorskip("jax")
    import jax

    if len(jax.devices()) < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = build_mesh(ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2, data_parallel_size=2))
    assert dict(mesh.shape) == {"data": 2, "pcp": 1, "tensor": 2, "dcp": 2}
    assert axes("tensor") == ("tensor", "dcp")


def test_context_parallel_with_attention_kernels_is_refused():
    cfg = PRESETS["tiny-dense"].replace(attention_impl="kernel")
    with pytest.raises(ParallelLayoutError, match="context parallelism runs the reference attention only"):
        check_layout(cfg, ParallelConfig(prefill_context_parallel_size=2), available_devices=8)
    check_layout(cfg, ParallelConfig(tensor_parallel_size=2), available_devices=8)  # TP runs the kernels
