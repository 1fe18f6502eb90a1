"""Small model configurations with random weights, for tests and experiments.

Presets reuse the embedded model's vocabulary size so the embedded tokenizer serves them.
"""
from __future__ import annotations

from agentjax.config import (BlockSparseConfig, CompressedAttentionConfig, HyperConnectionConfig, KDAConfig, MLAConfig,
                             ModelConfig, MoEConfig, RopeScaling)
from agentjax.errors import ModelLoadError

SMOLLM2_VOCAB = 49152


def _minimax_m3_moe(experts: int, top_k: int, inner: int, shared: int) -> MoEConfig:
    """MiniMax-M3's MoE: sigmoid + bias router, renormalised, routed sum x2, one shared expert, swigluoai."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=1, shared_intermediate_size=shared, scoring="sigmoid", use_routing_bias=True,
                     routed_scaling_factor=2.0, activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)


def _minimax_m3_layers(dense: int, sparse: int) -> dict:
    return dict(layer_types=("full_attention",) * dense + ("block_sparse_attention",) * sparse,
                mlp_layer_types=("dense",) * dense + ("moe",) * sparse)


def _kimi_k3_moe(experts: int, top_k: int, inner: int, latent: int, eps: float) -> MoEConfig:
    """Kimi-K3's latent MoE: sigmoid + bias router with one group, renormalised, x1.0, two shared
    experts, routed experts in a `latent`-wide space with an RMSNorm, SiTU-GLU (beta 4, linear beta 25)."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=2, scoring="sigmoid", use_routing_bias=True, num_expert_groups=1,
                     topk_groups=1, renormalize=True, routed_scaling_factor=1.0, activation="situ",
                     situ_beta=4.0, situ_linear_beta=25.0, latent_size=latent, latent_norm=True, norm_eps=eps)


def _kimi_k3_layers(num_layers: int) -> dict:
    """Kimi-K3's layer pattern: MLA at 0-based i % 4 == 3 and at the last layer, KDA elsewhere; layer 0
    has the dense MLP, every other layer the MoE."""
    mla = {i for i in range(num_layers) if i % 4 == 3} | {num_layers - 1}
    return dict(layer_types=tuple("mla" if i in mla else "kda" for i in range(num_layers)),
                mlp_layer_types=("dense",) + ("moe",) * (num_layers - 1))


def _dsv4_moe(experts: int, top_k: int, inner: int, limit: float = 10.0) -> MoEConfig:
    """DeepSeek-V4's MoE: sqrt-softplus + bias router, renormalised, x2.5, one shared expert, SwiGLU with
    clamped inputs."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=1, shared_intermediate_size=inner, scoring="sqrtsoftplus", use_routing_bias=True,
                     renormalize=True, routed_scaling_factor=2.5, activation="clamped_swiglu", swiglu_limit=limit)


def _dsv4_pro_layers(num_layers: int, hash_layers: int) -> dict:
    """DeepSeek-V4-Pro's pattern: HCA at layers 0-1, then CSA at even and HCA at odd layers; the first
    `hash_layers` MoE layers hash-routed."""
    return dict(layer_types=tuple("csa" if i >= 2 and i % 2 == 0 else "hca" for i in range(num_layers)),
                mlp_layer_types=("hash_moe",) * hash_layers + ("moe",) * (num_layers - hash_layers))


PRESETS: dict[str, ModelConfig] = {
    "tiny-dense": ModelConfig(
        architecture="llama",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-dense",
    ),
    "tiny-sliding": ModelConfig(
        architecture="gemma3",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        local_rope_theta=10_000.0,
        sliding_window=8,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        hidden_activation="gelu_tanh",
        embedding_multiplier=8.0,
        use_qk_norm=True,
        use_sandwich_norms=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-sliding",
    ),
    # A long context window (1M positions) on a tiny model: for long-prompt serving tests
    # (chunked prefill, paged KV at 30K+ tokens) without a real model's cost.
    "tiny-long": ModelConfig(
        architecture="llama",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1 << 20,
        rope_theta=10_000_000.0,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-long",
    ),
    # ARCHITECTURES.md 5.3 at the SmolLM2 vocabulary (so hidden 32 keeps it under 4M parameters):
    # dense GQA layer + dense swigluoai MLP, then block-sparse GQA with the indexer (2 heads x 32,
    # blocks of 4, top-2, local block forced), Gemma per-head QK norm, partial RoPE (16 of 32),
    # sigmoid + bias MoE with a shared expert, and one MTP module.
    "tiny-minimax-m3": ModelConfig(
        architecture="minimax_m3",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=32,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        rotary_dim=16,
        **_minimax_m3_layers(dense=1, sparse=3),
        tie_word_embeddings=False,
        hidden_activation="swigluoai",
        use_qk_norm=True,
        block_sparse=BlockSparseConfig(index_num_heads=2, index_head_dim=32, block_size=4, topk_blocks=2,
                                       local_blocks=1),
        moe=_minimax_m3_moe(experts=8, top_k=2, inner=64, shared=64),
        num_mtp_modules=1,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-minimax-m3",
    ),
    # ARCHITECTURES.md 5.2 at the SmolLM2 vocabulary (hidden 32 keeps it under 4M parameters): KDA
    # layers 0-2 with their recurrent state (full-rank output gate, log-decay bounded by -5), gated
    # NoPE MLA (q LoRA) at layer 3, block attention residuals of 2 layers (blocks start at layers 0
    # and 2, both KDA), a dense SiTU layer 0, latent MoE (32 -> 16 with its norm), 2 shared experts,
    # sigmoid + bias router with one group.
    "tiny-kimi-k3": ModelConfig(
        architecture="kimi_linear",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=2,
        num_kv_heads=2,
        head_dim=24,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        **_kimi_k3_layers(4),
        tie_word_embeddings=False,
        hidden_activation="situ",
        attn_res_block_size=2,
        mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32,
                      output_gate=True),
        kda=KDAConfig(num_heads=2, head_dim=16, conv_kernel_size=4,
                      full_rank_gate=True, gate_lower_bound=-5.0),
        moe=_kimi_k3_moe(experts=8, top_k=2, inner=32, latent=16, eps=1e-5),
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-kimi-k3",
    ),
    # ARCHITECTURES.md 5.1 at the SmolLM2 vocabulary (hidden 32 keeps it near 4M parameters): a
    # sliding-window-only layer, CSA (4:1 entries, lightning indexer 4 x 16 choosing 8) and HCA (16:1),
    # all with a 16-token window of shared-KV MQA rows, sinks, q LoRA and the grouped output projection;
    # YaRN on the compress RoPE; mHC with 4 streams; a hash-routed MoE layer, then sqrt-softplus + bias
    # routing, a shared expert, x2.5, the clamped SwiGLU; one MTP module.
    "tiny-dsv4": ModelConfig(
        architecture="deepseek_v4",
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        rotary_dim=8,
        sliding_window=16,
        layer_types=("swa_mqa", "csa", "hca", "csa"),
        mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        tie_word_embeddings=False,
        hyper_connections=HyperConnectionConfig(num_streams=4, sinkhorn_iterations=20, eps=1e-6),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=32, o_lora_rank=16, o_groups=2, csa_rate=4, hca_rate=16, index_num_heads=4,
            index_head_dim=16, index_topk=8, compress_rope_theta=160_000.0,
            compress_rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=8192,
                                              attention_factor=1.0)),
        moe=_dsv4_moe(experts=8, top_k=2, inner=32),
        num_mtp_modules=1,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-dsv4",
    ),
}

# Full-size configurations: abstract shapes only (agentjax.models.model_size), never allocated.
FULL_SIZE_PRESETS: dict[str, ModelConfig] = {
    # MiniMax-M3 (ARCHITECTURES.md sections 0 and 4): 3 dense GQA + 57 block-sparse GQA layers, 128-token pages.
    "minimax-m3": ModelConfig(
        architecture="minimax_m3",
        vocab_size=200064,
        hidden_size=6144,
        intermediate_size=12288,
        num_layers=60,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=524288,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        rotary_dim=64,
        **_minimax_m3_layers(dense=3, sparse=57),
        tie_word_embeddings=False,
        hidden_activation="swigluoai",
        use_qk_norm=True,
        block_sparse=BlockSparseConfig(index_num_heads=4, index_head_dim=128, block_size=128, topk_blocks=16,
                                       local_blocks=1, required_page_tokens=128),
        moe=_minimax_m3_moe(experts=128, top_k=4, inner=3072, shared=3072),
        num_mtp_modules=1,
        bos_token_id=200034,
        eos_token_ids=(200020,),
        dtype="bfloat16",
        name="minimax-m3",
    ),
    # Kimi-K3 (ARCHITECTURES.md sections 0, 4, 6; the published text_config): 69 KDA (96 x 128) + 24
    # gated NoPE MLA layers (96 heads, q LoRA 1536, latent 512 + 64), AttnRes blocks of 12, a dense
    # SiTU layer 0 (33792), 92 latent MoE layers (896 experts, top 16, 3072 wide in a 3584 latent).
    "kimi-k3": ModelConfig(
        architecture="kimi_linear",
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=33792,
        num_layers=93,
        num_heads=96,
        num_kv_heads=96,
        head_dim=192,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-5,
        **_kimi_k3_layers(93),
        tie_word_embeddings=False,
        hidden_activation="situ",
        attn_res_block_size=12,
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                      q_lora_rank=1536, output_gate=True),
        kda=KDAConfig(num_heads=96, head_dim=128, conv_kernel_size=4,
                      full_rank_gate=True, gate_lower_bound=-5.0),
        moe=_kimi_k3_moe(experts=896, top_k=16, inner=3072, latent=3584, eps=1e-5),
        bos_token_id=163584,
        eos_token_ids=(163586,),
        dtype="bfloat16",
        name="kimi-k3",
    ),
    # DeepSeek-V4-Pro (ARCHITECTURES.md sections 0, 4, 6): 61 layers (31 HCA at 128:1, 30 CSA at 4:1 with a
    # 64 x 128 indexer keeping 1024 entries), every layer a 128-token window of 512-wide shared-KV MQA rows
    # (448 NoPE + 64 RoPE), q LoRA 1536, output 16 groups x 1024, mHC 4 streams, 384 experts top-6 (3072
    # wide) + 1 shared, the first 3 hash-routed, 1 MTP module; KV sized as vLLM's fp8_ds_mla stores it.
    "deepseek-v4-pro": ModelConfig(
        architecture="deepseek_v4",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=3072,
        num_layers=61,
        num_heads=128,
        num_kv_heads=1,
        head_dim=512,
        max_position_embeddings=1048576,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        rotary_dim=64,
        sliding_window=128,
        **_dsv4_pro_layers(61, hash_layers=3),
        tie_word_embeddings=False,
        hyper_connections=HyperConnectionConfig(num_streams=4, sinkhorn_iterations=20, eps=1e-6),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=1536, o_lora_rank=1024, o_groups=16, csa_rate=4, hca_rate=128, index_num_heads=64,
            index_head_dim=128, index_topk=1024, compress_rope_theta=160_000.0,
            compress_rope_scaling=RopeScaling(kind="yarn", factor=16.0, original_max_position_embeddings=65536,
                                              attention_factor=1.0),
            kv_format="fp8_ds_mla"),
        moe=_dsv4_moe(experts=384, top_k=6, inner=3072),
        num_mtp_modules=1,
        bos_token_id=0,
        eos_token_ids=(1,),
        dtype="bfloat16",
        name="deepseek-v4-pro",
    ),
}


def preset_config(name: str, *, abstract: bool = False) -> ModelConfig:
    """A preset's config. Full-size presets only with `abstract=True` (for shapes and counts):
    loading one would allocate its full weights."""
    if name in FULL_SIZE_PRESETS:
        if not abstract:
            raise ModelLoadError(
                f"preset {name!r} is full size: it builds abstract shapes only (agentjax.models.model_size); "
                f"runnable presets: {', '.join(sorted(PRESETS))}"
            )
        return FULL_SIZE_PRESETS[name]
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}, "
                             f"and full size (abstract only): {', '.join(sorted(FULL_SIZE_PRESETS))}")
    return PRESETS[name]
