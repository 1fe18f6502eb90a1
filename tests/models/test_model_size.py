"""Parameter counts and KV bytes from abstract shapes: the full-size MiniMax-M3 preset against
ARCHITECTURES.md, and the tiny preset's size and structure."""
from __future__ import annotations

import pytest

from agentjax.errors import ModelLoadError
from agentjax.models import load_model
from agentjax.models.model_size import model_size
from agentjax.models.presets import PRESETS, preset_config


def _within(value: float, target: float, tolerance: float = 0.01) -> bool:
    return abs(value - target) <= tolerance * target


def test_full_size_minimax_m3_matches_architectures_md():
    size = model_size(preset_config("minimax-m3", abstract=True))
    # ARCHITECTURES.md section 0: 426.2B total (+7.5B per MTP module) / 26.0B active; 137,472 B KV per token (bf16)
    assert _within(size.total_params, 426.2e9), size.total_params
    assert _within(size.mtp_params_per_module, 7.5e9), size.mtp_params_per_module
    assert _within(size.active_params, 26.0e9), size.active_params
    assert _within(size.kv_bytes_per_token, 137_472), size.kv_bytes_per_token
    assert size.page_tokens == 128 and size.state_bytes_per_sequence == 0


def test_full_size_preset_is_never_allocated():
    with pytest.raises(ModelLoadError, match="abstract shapes only"):
        load_model("preset:minimax-m3")


def test_tiny_minimax_m3_is_small_and_keeps_every_structural_feature():
    cfg = PRESETS["tiny-minimax-m3"]
    size = model_size(cfg)
    assert 1e6 <= size.total_params + size.mtp_params <= 4e6
    assert size.mtp_params_per_module > 0 and size.active_params < size.total_params
    assert {"full_attention", "block_sparse_attention"} == set(cfg.layer_types)
    assert {"dense", "moe"} == set(cfg.mlp_layer_types)
    assert cfg.use_qk_norm and cfg.hidden_activation == "swigluoai" and cfg.rope_dim < cfg.head_dim
    assert cfg.block_sparse.local_blocks >= 1 and cfg.block_sparse.index_num_heads == cfg.num_kv_heads
    moe = cfg.moe
    assert moe.scoring == "sigmoid" and moe.use_routing_bias and moe.num_shared_experts == 1
    assert moe.activation == "swigluoai" and moe.routed_scaling_factor == 2.0
    assert not cfg.tie_word_embeddings and cfg.num_mtp_modules == 1
    # the KV plan: K/V for every layer, indexer keys for the sparse ones
    per_layer_kv = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert size.kv_bytes_per_token == cfg.num_layers * per_layer_kv + 3 * cfg.block_sparse.index_head_dim * 4


def test_full_size_kv_pages_must_hold_128_tokens():
    from agentjax.errors import InvalidRequestError
    from agentjax.kv.cache_layout import kv_buffer_specs

    cfg = preset_config("minimax-m3", abstract=True)
    with pytest.raises(InvalidRequestError, match="requires 128-token KV pages"):
        kv_buffer_specs(cfg, 16)
    assert sum(spec.bytes_per_page for spec in kv_buffer_specs(cfg, 128)) == 128 * 137_472


def test_full_size_deepseek_v4_pro_matches_architectures_md():
    size = model_size(preset_config("deepseek-v4-pro", abstract=True), page_tokens=256)
    # ARCHITECTURES.md section 0: 1,573.0B (1,598.8B with MTP) / 49.8B active; 5,511 B of KV per token
    # (fp8_ds_mla rows + FP8 indexer keys); about 23.3 MB of window-bounded state per sequence.
    assert _within(size.total_params, 1573.0e9), size.total_params
    assert _within(size.total_params + size.mtp_params, 1598.8e9), size.mtp_params
    assert _within(size.active_params, 49.8e9), size.active_params
    assert _within(size.kv_bytes_per_token, 5_511), size.kv_bytes_per_token
    assert _within(size.window_bytes_per_sequence, 23.3e6), size.window_bytes_per_sequence
    assert size.state_bytes_per_sequence == 0


def test_deepseek_v4_pro_pool_layout_packs_its_growing_kinds_into_one_128_token_page_group():
    from agentjax.kv.layout_build import build_layout

    layout = build_layout(preset_config("deepseek-v4-pro", abstract=True), 16, memory_bytes=100 * 2**30)
    growing = [g for g in layout.groups if g.hit_rule == "prefix"]
    assert len(growing) == 1 and growing[0].tokens_per_page == 128
    # fp8_ds_mla entries and FP8 indexer keys (ARCHITECTURES.md): 30 CSA x (584/4 + 132/4) + 31 HCA x 584/128
    assert layout.page_bytes(growing[0].group) == 128 * 30 * (146 + 33) + 31 * 584
    # the window and compressor-input kinds keep 16-token pages of their own
    assert {g.tokens_per_page for g in layout.groups if g.hit_rule == "window"} == {16}


def test_tiny_dsv4_keeps_every_structural_feature():
    cfg = PRESETS["tiny-dsv4"]
    size = model_size(cfg)
    assert 1e6 <= size.total_params + size.mtp_params <= 4e6 and size.mtp_params_per_module > 0
    assert set(cfg.layer_types) == {"swa_mqa", "csa", "hca"} and set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    attention = cfg.compressed_attention
    assert cfg.vocab_size == 49152 and cfg.num_kv_heads == 1 and cfg.rope_dim < cfg.head_dim
    assert attention.o_groups > 1 and attention.compress_rope_scaling.kind == "yarn"
    assert 4 * cfg.sliding_window // attention.csa_rate > attention.index_topk  # beyond 4 windows it drops entries
    assert cfg.hyper_connections.num_streams == 4 and cfg.num_mtp_modules == 1
    moe = cfg.moe
    assert (moe.scoring, moe.activation, moe.num_shared_experts, moe.routed_scaling_factor) == (
        "sqrtsoftplus", "clamped_swiglu", 1, 2.5) and moe.use_routing_bias
