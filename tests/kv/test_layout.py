"""Tests of agentjax/kv/layout.py: page groups, tokens per page, slab geometry and what a request costs."""
from __future__ import annotations

import dataclasses

import pytest

from agentjax.config import CompressedAttentionConfig, ModelConfig
from agentjax.errors import InvalidRequestError
from agentjax.kv.cache_layout import cost_aware_checkpoint_tokens, kv_buffer_specs
from agentjax.kv.layout_build import build_layout
from agentjax.kv.cache_layout import specs_from_model_config
from agentjax.kv.specs import plan_groups
from agentjax.models import preset_config

MIB = 2**20


def gemma_like(layers=6, window=64) -> ModelConfig:
    """Five sliding layers then one full layer, repeated (Gemma-3's pattern)."""
    types = tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers))
    return ModelConfig(architecture="gemma3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=layers,
                       num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=1 << 16,
                       sliding_window=window, layer_types=types, name="gemma-like")


def dsv4_like(csa_rate=4, hca_rate=32) -> ModelConfig:
    return ModelConfig(
        architecture="deepseek_v4", vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=4, num_heads=2,
        num_kv_heads=1, head_dim=16, max_position_embeddings=1 << 20, rotary_dim=8, sliding_window=16,
        layer_types=("swa_mqa", "csa", "hca", "csa"), mlp_layer_types=("dense",) * 4,
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=16, o_lora_rank=8, o_groups=2, csa_rate=csa_rate, hca_rate=hca_rate, index_num_heads=2,
            index_head_dim=8, index_topk=4), name="dsv4-like")


def test_a_one_kind_model_is_one_group_whose_slab_is_its_page():
    layout = build_layout(preset_config("tiny-dense"), 16, memory_bytes=MIB)
    (group,) = layout.groups
    assert group.tokens_per_page == 16 and group.pages_per_slab == 1
    assert layout.slab_words == group.page_words and layout.num_slabs == MIB // layout.slab_bytes
    assert layout.tokens_per_gb(30_000) == pytest.approx(layout.ideal_tokens_per_gb(30_000), rel=1e-3)


def test_sliding_and_full_attention_keep_16_token_pages_and_pay_only_what_they_store():
    cfg = gemma_like()
    layout = build_layout(cfg, 16, memory_bytes=64 * MIB)
    shared = build_layout(cfg, 16, memory_bytes=64 * MIB, mode="shared")
    assert [(g.hit_rule, g.tokens_per_page) for g in layout.groups] == [("window", 16), ("prefix", 16)]
    # a sliding page holds 5 layers, a full page 1: five full pages share a slab with one sliding page
    window, full = layout.groups
    assert window.page_words == 5 * full.page_words and layout.slab_words % window.page_words == 0
    assert full.pages_per_slab == 5 * window.pages_per_slab
    pool, old, ideal = (layout.tokens_per_gb(32_768), shared.tokens_per_gb(32_768),
                        layout.ideal_tokens_per_gb(32_768))
    assert pool / ideal > 0.99 and old / ideal < 0.2  # the shared layout reserves all 6 layers per page id


def test_prefix_kinds_that_grow_together_share_one_page_group():
    layout = build_layout(preset_config("tiny-minimax-m3"), 16, memory_bytes=64 * MIB)
    (group,) = layout.groups
    assert {layout.kinds[k].role for k in group.kinds} == {"kv", "index"}
    assert group.hit_spec.kind == "packed" and group.hit_spec.token_granular
    assert layout.tokens_per_gb(30_000) == pytest.approx(layout.ideal_tokens_per_gb(30_000), rel=1e-3)


@pytest.mark.parametrize("rates", [(4, 32), (4, 128)])
def test_a_deepseek_v4_entry_group_takes_whole_entries_while_the_windows_keep_16_tokens(rates):
    cfg = dsv4_like(*rates)
    with pytest.raises(InvalidRequestError, match=f"multiple of {rates[1]} tokens"):
        kv_buffer_specs(cfg, 16)  # one page size for every kind: the default block size cannot serve
    layout = build_layout(cfg, 16, memory_bytes=64 * MIB)
    tokens = {layout.group_names()[g.group]: g.tokens_per_page for g in layout.groups}
    assert tokens["entries+index_entries"] == rates[1]
    assert {t for name, t in tokens.items() if name != "entries+index_entries"} == {16}


def test_a_state_page_holds_one_state_and_every_plane_is_aligned_to_its_cells():
    layout = build_layout(preset_config("tiny-kimi-k3"), 16, memory_bytes=64 * MIB)
    state, latent = layout.groups
    # a state every 112 tokens: the fewest whose float32 latent (96 bytes a token) outweighs a state (9600 bytes)
    assert state.hit_rule == "checkpoint" and state.tokens_per_page == 112 and latent.tokens_per_page == 16
    for kind in layout.kinds:
        assert layout.slab_words % kind.cell_words == 0 and kind.plane_offset % kind.cell_words == 0
        group = layout.groups[kind.group]
        assert kind.plane_offset + group.pages_per_slab * kind.slots * kind.cell_words <= layout.slab_words
    assert layout.pages_per_request(30_000) == (1, 1875)


def test_page_ids_of_each_group_follow_the_previous_group():
    layout = build_layout(preset_config("tiny-dsv4"), 16, memory_bytes=8 * MIB)
    base = 0
    for g in layout.groups:
        assert g.id_base == base and g.num_ids == layout.num_slabs * g.pages_per_slab
        base += g.num_ids
    assert layout.num_ids == base


@pytest.mark.parametrize("name", ["minimax-m3", "kimi-k3", "deepseek-v4-pro"])
def test_full_size_presets_hold_within_ten_percent_of_the_ideal_tokens_per_gb(name):
    cfg = preset_config(name, abstract=True)
    if cfg.compressed_attention is not None:  # the KV format the engine runs today: the model's dtype
        cfg = cfg.replace(compressed_attention=dataclasses.replace(cfg.compressed_attention, kv_format="model_dtype"))
    layout = build_layout(cfg, 16, memory_bytes=100 * 2**30)
    for context in (32_768, 131_072):
        assert layout.tokens_per_gb(context) >= 0.9 * layout.ideal_tokens_per_gb(context)


def test_a_pool_past_int32_rows_is_refused():
    with pytest.raises(InvalidRequestError, match="int32"):
        build_layout(preset_config("tiny-dense"), 16, memory_bytes=600 * 2**30)


def test_the_shared_layout_is_the_managers_old_plan_and_sizes_num_kv_blocks_pages():
    cfg = preset_config("tiny-kimi-k3")
    shared = build_layout(cfg, 16, num_pages=40, mode="shared")
    interval = cost_aware_checkpoint_tokens(cfg, 16)
    assert shared.manager_plan() == plan_groups(specs_from_model_config(cfg, interval), 16, scale_tokens_per_page=False)
    assert shared.num_slabs == 40 and shared.slab_bytes == cfg.kv_bytes_per_page(16)
    pool = build_layout(cfg, 16, num_pages=40)  # the same bytes, carved by group
    assert pool.total_bytes <= 40 * shared.slab_bytes < pool.total_bytes + pool.slab_bytes


@pytest.mark.parametrize("name, role, ratio", [("minimax-m3", "kv", 256 / 132), ("kimi-k3", "latent", 1152 / 580)])
def test_full_size_fp8_kv_halves_the_attention_kinds_bytes_per_token(name, role, ratio):
    """bfloat16 K/V head rows of 128 values (256 B) become 132 B of FP8 and scale; Kimi-K3's 576-value
    latent rows 1,152 B -> 580 B. Indexer keys and KDA states keep their bytes (a state is saved every
    more tokens: the cost-aware interval follows the lighter prefix KV)."""
    base = preset_config(name, abstract=True)
    layouts = {dtype: build_layout(base.replace(kv_cache_dtype=dtype), 16, memory_bytes=100 * 2**30)
               for dtype in ("auto", "fp8")}

    def per_token(layout, wanted):
        return sum(k.slots * k.cell_words * layout.word_bytes / layout.groups[k.group].tokens_per_page
                   for k in layout.kinds if k.role == wanted)

    assert per_token(layouts["auto"], role) / per_token(layouts["fp8"], role) == pytest.approx(ratio)
    assert per_token(layouts["auto"], "index") == per_token(layouts["fp8"], "index")
    states = [[k.slots * k.cell_words for k in layout.kinds if k.role == "state"] for layout in layouts.values()]
    assert states[0] == states[1]
    for context in (32_768, 131_072):
        fp8 = layouts["fp8"]
        assert fp8.tokens_per_gb(context) > 1.4 * layouts["auto"].tokens_per_gb(context)
        assert fp8.tokens_per_gb(context) >= 0.9 * fp8.ideal_tokens_per_gb(context)


def test_fp8_kv_is_refused_for_deepseek_v4s_kinds_by_name():
    with pytest.raises(InvalidRequestError, match="csa, hca.*window, entries, index_entries"):
        dsv4_like().replace(kv_cache_dtype="fp8")
