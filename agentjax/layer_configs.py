"""The sub-configurations that layer kinds need: MLA, KDA, block-sparse attention, DeepSeek-V4's
compressed attention and hyper-connections, MoE routing and experts, and RoPE scaling; the names of the
gated activations and router scorings they accept.

Frozen dataclasses held by `agentjax.config.ModelConfig` (which re-exports them). Host only:
never imports jax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentjax.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: one shared latent row per token (K and V both come from it)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q projection
    use_rope: bool = False  # Kimi's MLA applies no RoPE; the rope part of the latent is still shared
    output_gate: bool = False  # Kimi-K3's gated MLA: `o_proj(attn * sigmoid(g_proj(x)))`
    # eps of q_a_layernorm and kv_a_layernorm (transformers' Kimi builds them with 1e-6 whatever
    # rms_norm_eps says)
    norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values stored per token in the cache: the normed latent, then the shared rope part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class KDAConfig:
    """Kimi delta attention: short convolution, per-channel gated delta rule, gated output norm."""

    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4
    # Kimi-K3: the output gate is one full-rank `g_proj` [hidden, H*D] instead of Kimi-Linear's low-rank
    # `g_b_proj(g_a_proj(x))`.
    full_rank_gate: bool = False
    # Kimi-K3: the per-channel log-decay is `gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`,
    # bounded in (gate_lower_bound, 0), instead of `-exp(A_log) * softplus(f + dt_bias)`. None: the latter.
    gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise InvalidRequestError(f"kda.gate_lower_bound must be negative or None, got {self.gate_lower_bound}")

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim

    @property
    def state_size(self) -> int:
        """Floats of one layer's state: the recurrent [heads, dim, dim] and the conv tail."""
        return self.num_heads * self.head_dim * self.head_dim + self.conv_dim * (self.conv_kernel_size - 1)


@dataclass(frozen=True)
class BlockSparseConfig:
    """MiniMax-M3's block-sparse attention: an indexer picks the top-k key blocks per KV head.

    Blocks of `block_size` key positions are anchored at position 0; each query keeps its
    `local_blocks` latest blocks and the best of the others, `topk_blocks` in all.
    `required_page_tokens`: tokens per KV page the model's kernels demand (the real MiniMax-M3:
    128), None: any page size.
    """

    index_num_heads: int
    index_head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int = 1
    required_page_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("index_num_heads", "index_head_dim", "block_size", "topk_blocks"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"block_sparse {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.local_blocks <= self.topk_blocks:
            raise InvalidRequestError(
                f"block_sparse local_blocks must be in [0, topk_blocks={self.topk_blocks}], got {self.local_blocks}"
            )
        if self.required_page_tokens is not None and self.required_page_tokens < 1:
            raise InvalidRequestError(
                f"block_sparse required_page_tokens must be >= 1 or None, got {self.required_page_tokens}"
            )


@dataclass(frozen=True)
class HyperConnectionConfig:
    """DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is `num_streams`
    parallel streams per token, mixed around every block with weights made doubly stochastic by
    `sinkhorn_iterations` Sinkhorn-Knopp steps (agentjax/models/residual.py)."""

    num_streams: int = 4
    sinkhorn_iterations: int = 20
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("num_streams", "sinkhorn_iterations"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"hyper_connections {name} must be >= 1, got {getattr(self, name)}")
        if not self.eps >= 0:
            raise InvalidRequestError(f"hyper_connections eps must be >= 0, got {self.eps}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3" or "yarn"; low/high_freq_factor serve
    llama3, beta_fast/beta_slow/attention_factor/truncate serve YaRN (transformers' names; an
    attention_factor of None is YaRN's `0.1 ln(factor) + 1`), original_max_position_embeddings both."""

    kind: Literal["linear", "llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention ("swa_mqa", "csa", "hca" layers): one K=V head per token (`head_dim`,
    the last `rotary_dim` channels rotated), q LoRA, per-head sinks, a grouped low-rank output
    projection, a `sliding_window` of raw rows, and for "csa"/"hca" compressed entries of `csa_rate`
    / `hca_rate` tokens; "csa" layers keep the `index_topk` entries a lightning indexer
    (`index_num_heads` x `index_head_dim`) scores highest. "swa_mqa" layers rotate with the model's
    `rope_theta`; "csa"/"hca" layers with `compress_rope_theta` and `compress_rope_scaling`.
    `kv_format`: "model_dtype" stores rows in the model's dtype; "fp8_ds_mla" sizes the KV plan as
    vLLM stores it (584 B per entry, 132 B per FP8 index key) for abstract full-size presets."""

    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    csa_rate: int = 4
    hca_rate: int = 128
    index_num_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    compress_rope_theta: float = 160_000.0
    compress_rope_scaling: RopeScaling | None = None
    kv_format: Literal["model_dtype", "fp8_ds_mla"] = "model_dtype"

    def __post_init__(self) -> None:
        for name in ("q_lora_rank", "o_lora_rank", "o_groups", "csa_rate", "hca_rate", "index_num_heads",
                     "index_head_dim", "index_topk"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"compressed_attention {name} must be >= 1, got {getattr(self, name)}")
        if self.kv_format not in ("model_dtype", "fp8_ds_mla"):
            raise InvalidRequestError(
                f"compressed_attention kv_format must be 'model_dtype' or 'fp8_ds_mla', got {self.kv_format!r}")


# silu: llama's SwiGLU. gelu_tanh: Gemma's GeGLU. swigluoai: MiniMax-M3's clamped SwiGLU.
# situ: Kimi-K3's SiTU-GLU. clamped_swiglu: DeepSeek-V4's SwiGLU with clamped inputs.
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai", "situ", "clamped_swiglu")
# Router scores from logits (agentjax/models/moe.py computes them; names as HF configs spell them).
MOE_SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def check_gated_activation(kind: str, swiglu_limit: float, situ_beta: float, situ_linear_beta: float | None) -> None:
    """Raise unless `kind` is one of `GATED_ACTIVATIONS` and its constants are positive."""
    if kind not in GATED_ACTIVATIONS:
        raise UnsupportedModelError(f"gated activation {kind!r} is not supported; expected one of {GATED_ACTIVATIONS}")
    positive = {"swiglu_limit": swiglu_limit, "situ_beta": situ_beta}
    if situ_linear_beta is not None:
        positive["situ_linear_beta"] = situ_linear_beta
    for name, value in positive.items():
        if not value > 0:
            raise ModelLoadError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's routing and expert shapes (agentjax/models/moe.py's docstring gives the HF field names)."""

    num_experts: int
    num_experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    # Width of the shared experts as one MLP; None: expert_intermediate_size * num_shared_experts.
    shared_intermediate_size: int | None = None
    scoring: str = "softmax"
    use_routing_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    # Kimi-K3's latent MoE: routed experts run at this width (None: at the hidden size).
    latent_size: int | None = None
    latent_norm: bool = False
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.scoring not in MOE_SCORINGS:
            raise UnsupportedModelError(
                f"MoE scoring {self.scoring!r} is not supported; expected one of {MOE_SCORINGS}"
            )
        check_gated_activation(self.activation, self.swiglu_limit, self.situ_beta, self.situ_linear_beta)
        at_least_one = ("num_experts", "num_experts_per_token", "expert_intermediate_size",
                        "num_expert_groups", "topk_groups")
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ModelLoadError(f"MoE {name} must be >= 1, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ModelLoadError(f"MoE num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.num_shared_experts and self.shared_size < 1:
            raise ModelLoadError(f"MoE shared_intermediate_size must be >= 1, got {self.shared_size}")
        groups = self.num_expert_groups
        if self.num_experts % groups:
            raise ModelLoadError(f"MoE num_expert_groups={groups} must divide num_experts={self.num_experts}")
        if self.topk_groups > groups:
            raise ModelLoadError(f"MoE topk_groups must be in [1, {groups}], got {self.topk_groups}")
        if groups > 1 and self.num_experts // groups < 2:
            raise ModelLoadError(
                f"MoE grouped top-k scores a group by its two best experts; num_experts={self.num_experts} "
                f"over num_expert_groups={groups} leaves {self.num_experts // groups}"
            )
        choosable = self.topk_groups * (self.num_experts // groups)
        if self.num_experts_per_token > choosable:
            raise ModelLoadError(
                f"MoE num_experts_per_token must be in [1, {choosable}] (experts in the topk_groups best "
                f"groups), got {self.num_experts_per_token}"
            )
        if self.latent_size is not None and self.latent_size < 1:
            raise ModelLoadError(f"MoE latent_size must be >= 1 or None, got {self.latent_size}")
        if self.latent_norm and self.latent_size is None:
            raise ModelLoadError("MoE latent_norm needs a latent_size")

    @property
    def shared_size(self) -> int:
        """Intermediate width of the shared experts taken together (0 without shared experts)."""
        if not self.num_shared_experts:
            return 0
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.expert_intermediate_size * self.num_shared_experts
