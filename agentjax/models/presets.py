"""Model configurations by name: tiny ones with random weights for tests and experiments, full-size ones
for abstract shapes only. Each family is described once; a preset is that description at one size.

Tiny presets reuse the embedded model's vocabulary so the embedded tokenizer serves them.
"""
from __future__ import annotations

from agentjax.config import (BlockSparseConfig, CompressedAttentionConfig, HyperConnectionConfig, KDAConfig, MLAConfig,
                             ModelConfig, MoEConfig, RopeScaling)
from agentjax.errors import ModelLoadError

SMOLLM2_VOCAB = 49152
# The embedded SmolLM2 tokenizer's vocabulary and special tokens, at the configs' default dtype.
_SMOLLM2 = dict(vocab_size=SMOLLM2_VOCAB, bos_token_id=1, eos_token_ids=(2,))


def _llama(name: str, *, max_positions: int, rope_theta: float) -> ModelConfig:
    """The tiny Llama: 2 GQA layers (4 query heads, 2 KV heads of 16) at hidden 64."""
    return ModelConfig(architecture="llama", name=name, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_positions,
                       rope_theta=rope_theta, **_SMOLLM2)


def _minimax_m3_moe(experts: int, top_k: int, inner: int) -> MoEConfig:
    """MiniMax-M3's MoE: sigmoid + bias router, renormalised, routed sum x2, one shared expert as wide as a
    routed one, swigluoai."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=1, shared_intermediate_size=inner, scoring="sigmoid", use_routing_bias=True,
                     routed_scaling_factor=2.0, activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)


def _minimax_m3(name: str, *, dense: int, sparse: int, moe: tuple[int, int, int], **sizes) -> ModelConfig:
    """MiniMax-M3 (ARCHITECTURES.md 5.3): `dense` GQA layers with a dense swigluoai MLP, then `sparse`
    block-sparse GQA layers with the indexer and the MoE (`moe`: experts, top-k, expert width); Gemma
    per-head QK norm, partial RoPE, one MTP module."""
    return ModelConfig(architecture="minimax_m3", name=name, num_layers=dense + sparse,
                       layer_types=("full_attention",) * dense + ("block_sparse_attention",) * sparse,
                       mlp_layer_types=("dense",) * dense + ("moe",) * sparse, rms_norm_eps=1e-6,
                       rope_theta=5_000_000.0, tie_word_embeddings=False, hidden_activation="swigluoai",
                       use_qk_norm=True, moe=_minimax_m3_moe(*moe), num_mtp_modules=1, **sizes)


def _kimi_k3(name: str, *, num_layers: int, heads: int, mla: dict, kda_head_dim: int,
             moe: tuple[int, int, int, int], **sizes) -> ModelConfig:
    """Kimi-K3 (ARCHITECTURES.md 5.2): KDA layers (`heads` heads with their recurrent state, full-rank
    output gate, log-decay bounded by -5) and gated NoPE MLA with q LoRA (`mla`: its sizes) in the
    pattern of `_kimi_k3_layers`; a dense SiTU layer 0, then the latent MoE (`moe`: experts, top-k,
    expert width, latent width)."""
    return ModelConfig(architecture="kimi_linear", name=name, num_layers=num_layers, num_heads=heads,
                       num_kv_heads=heads, head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                       rms_norm_eps=1e-5, **_kimi_k3_layers(num_layers), tie_word_embeddings=False,
                       hidden_activation="situ", mla=MLAConfig(**mla, output_gate=True),
                       kda=KDAConfig(num_heads=heads, head_dim=kda_head_dim, conv_kernel_size=4,
                                     full_rank_gate=True, gate_lower_bound=-5.0),
                       moe=_kimi_k3_moe(*moe), **sizes)


def _kimi_k3_layers(num_layers: int) -> dict:
    """Kimi-K3's layer pattern: MLA at 0-based i % 4 == 3 and at the last layer, KDA elsewhere; layer 0
    has the dense MLP, every other layer the MoE."""
    mla = {i for i in range(num_layers) if i % 4 == 3} | {num_layers - 1}
    return dict(layer_types=tuple("mla" if i in mla else "kda" for i in range(num_layers)),
                mlp_layer_types=("dense",) + ("moe",) * (num_layers - 1))


def _kimi_k3_moe(experts: int, top_k: int, inner: int, latent: int) -> MoEConfig:
    """Kimi-K3's latent MoE: sigmoid + bias router with one group, renormalised, x1.0, two shared
    experts, routed experts in a `latent`-wide space with an RMSNorm, SiTU-GLU (beta 4, linear beta 25)."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=2, scoring="sigmoid", use_routing_bias=True, num_expert_groups=1,
                     topk_groups=1, renormalize=True, routed_scaling_factor=1.0, activation="situ",
                     situ_beta=4.0, situ_linear_beta=25.0, latent_size=latent, latent_norm=True, norm_eps=1e-5)


def _deepseek_v4(name: str, *, layer_types: tuple[str, ...], hash_layers: int, yarn: tuple[float, int],
                 compressed: dict, moe: tuple[int, int, int], **sizes) -> ModelConfig:
    """DeepSeek-V4 (ARCHITECTURES.md 5.1): compressed attention (`compressed`: CSA and HCA rates, the
    lightning indexer, q LoRA and grouped output sizes) over a window of shared-KV MQA rows with sinks;
    YaRN (`yarn`: factor, original context) on the compress RoPE; mHC with 4 streams; the first
    `hash_layers` MoE layers hash-routed, then sqrt-softplus + bias routing, a shared expert, x2.5, the
    clamped SwiGLU (`moe`: experts, top-k, expert width); one MTP module."""
    factor, original = yarn
    rope = RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=original, attention_factor=1.0)
    return ModelConfig(architecture="deepseek_v4", name=name, num_layers=len(layer_types), layer_types=layer_types,
                       mlp_layer_types=("hash_moe",) * hash_layers + ("moe",) * (len(layer_types) - hash_layers),
                       num_kv_heads=1, rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                       hyper_connections=HyperConnectionConfig(num_streams=4, sinkhorn_iterations=20, eps=1e-6),
                       compressed_attention=CompressedAttentionConfig(
                           **compressed, compress_rope_theta=160_000.0, compress_rope_scaling=rope),
                       moe=_dsv4_moe(*moe), num_mtp_modules=1, **sizes)


def _dsv4_moe(experts: int, top_k: int, inner: int) -> MoEConfig:
    """DeepSeek-V4's MoE: sqrt-softplus + bias router, renormalised, x2.5, one shared expert, SwiGLU with
    inputs clamped to 10."""
    return MoEConfig(num_experts=experts, num_experts_per_token=top_k, expert_intermediate_size=inner,
                     num_shared_experts=1, shared_intermediate_size=inner, scoring="sqrtsoftplus", use_routing_bias=True,
                     renormalize=True, routed_scaling_factor=2.5, activation="clamped_swiglu", swiglu_limit=10.0)


def _dsv4_pro_layer_types(num_layers: int) -> tuple[str, ...]:
    """DeepSeek-V4-Pro's pattern: HCA at layers 0-1, then CSA at even and HCA at odd layers."""
    return tuple("csa" if i >= 2 and i % 2 == 0 else "hca" for i in range(num_layers))


PRESETS: dict[str, ModelConfig] = {cfg.name: cfg for cfg in (
    _llama("tiny-dense", max_positions=4096, rope_theta=10_000.0),
    ModelConfig(architecture="gemma3", name="tiny-sliding", hidden_size=64, intermediate_size=128, num_layers=3,
                num_heads=4, num_kv_heads=1, head_dim=16, max_position_embeddings=4096, rope_theta=1_000_000.0,
                local_rope_theta=10_000.0, sliding_window=8,
                layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                hidden_activation="gelu_tanh", embedding_multiplier=8.0, use_qk_norm=True, use_sandwich_norms=True,
                **_SMOLLM2),
    # A long context window (1M positions) on a tiny model: for long-prompt serving tests
    # (chunked prefill, paged KV at 30K+ tokens) without a real model's cost.
    _llama("tiny-long", max_positions=1 << 20, rope_theta=10_000_000.0),
    # Hidden 32 keeps it under 4M parameters at the SmolLM2 vocabulary: 1 dense + 3 block-sparse layers,
    # an indexer of 2 heads x 32 over blocks of 4 choosing 2 (the local block forced), RoPE on 16 of 32.
    _minimax_m3("tiny-minimax-m3", dense=1, sparse=3, moe=(8, 2, 64), hidden_size=32, intermediate_size=256,
                num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=32768, rotary_dim=16,
                block_sparse=BlockSparseConfig(index_num_heads=2, index_head_dim=32, block_size=4, topk_blocks=2,
                                               local_blocks=1), **_SMOLLM2),
    # Hidden 32 keeps it under 4M parameters: KDA layers 0-2, MLA at layer 3, block attention residuals of
    # 2 layers (blocks start at layers 0 and 2, both KDA), latent MoE 32 -> 16.
    _kimi_k3("tiny-kimi-k3", num_layers=4, heads=2, kda_head_dim=16, moe=(8, 2, 32, 16), hidden_size=32,
             intermediate_size=64, max_position_embeddings=32768, attn_res_block_size=2,
             mla=dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32),
             **_SMOLLM2),
    # Hidden 32 keeps it near 4M parameters: a sliding-window-only layer, CSA (4:1 entries, indexer 4 x 16
    # choosing 8) and HCA (16:1), all with a 16-token window; one hash-routed MoE layer.
    _deepseek_v4("tiny-dsv4", layer_types=("swa_mqa", "csa", "hca", "csa"), hash_layers=1, yarn=(4.0, 8192),
                 moe=(8, 2, 32), hidden_size=32, intermediate_size=32, num_heads=4, head_dim=32,
                 max_position_embeddings=32768, rotary_dim=8, sliding_window=16,
                 compressed=dict(q_lora_rank=32, o_lora_rank=16, o_groups=2, csa_rate=4, hca_rate=16,
                                 index_num_heads=4, index_head_dim=16, index_topk=8), **_SMOLLM2),
)}

# Full-size configurations: abstract shapes only (agentjax.models.model_size), never allocated.
FULL_SIZE_PRESETS: dict[str, ModelConfig] = {cfg.name: cfg for cfg in (
    # MiniMax-M3 (ARCHITECTURES.md sections 0 and 4): 3 dense GQA + 57 block-sparse GQA layers, 128-token pages.
    _minimax_m3("minimax-m3", dense=3, sparse=57, moe=(128, 4, 3072), hidden_size=6144, intermediate_size=12288,
                num_heads=64, num_kv_heads=4, head_dim=128, max_position_embeddings=524288, rotary_dim=64,
                block_sparse=BlockSparseConfig(index_num_heads=4, index_head_dim=128, block_size=128, topk_blocks=16,
                                               local_blocks=1, required_page_tokens=128),
                vocab_size=200064, bos_token_id=200034, eos_token_ids=(200020,), dtype="bfloat16"),
    # Kimi-K3 (ARCHITECTURES.md sections 0, 4, 6; the published text_config): 69 KDA (96 x 128) + 24
    # gated NoPE MLA layers (96 heads, q LoRA 1536, latent 512 + 64), AttnRes blocks of 12, a dense
    # SiTU layer 0 (33792), 92 latent MoE layers (896 experts, top 16, 3072 wide in a 3584 latent).
    _kimi_k3("kimi-k3", num_layers=93, heads=96, kda_head_dim=128, moe=(896, 16, 3072, 3584), hidden_size=7168,
             intermediate_size=33792, max_position_embeddings=1048576, attn_res_block_size=12,
             mla=dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
             vocab_size=163840, bos_token_id=163584, eos_token_ids=(163586,), dtype="bfloat16"),
    # DeepSeek-V4-Pro (ARCHITECTURES.md sections 0, 4, 6): 61 layers (31 HCA at 128:1, 30 CSA at 4:1 with a
    # 64 x 128 indexer keeping 1024 entries), every layer a 128-token window of 512-wide shared-KV MQA rows
    # (448 NoPE + 64 RoPE), q LoRA 1536, output 16 groups x 1024, mHC 4 streams, 384 experts top-6 (3072
    # wide) + 1 shared, the first 3 hash-routed, 1 MTP module; KV sized as vLLM's fp8_ds_mla stores it.
    _deepseek_v4("deepseek-v4-pro", layer_types=_dsv4_pro_layer_types(61), hash_layers=3, yarn=(16.0, 65536),
                 moe=(384, 6, 3072), hidden_size=7168, intermediate_size=3072, num_heads=128, head_dim=512,
                 max_position_embeddings=1048576, rotary_dim=64, sliding_window=128,
                 compressed=dict(q_lora_rank=1536, o_lora_rank=1024, o_groups=16, csa_rate=4, hca_rate=128,
                                 index_num_heads=64, index_head_dim=128, index_topk=1024, kv_format="fp8_ds_mla"),
                 vocab_size=129280, bos_token_id=0, eos_token_ids=(1,), dtype="bfloat16"),
)}


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
