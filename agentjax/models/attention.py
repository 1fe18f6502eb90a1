"""GQA attention over the paged KV cache, with sliding windows, partial RoPE and per-head QK norms.

Projects the ragged batch's tokens to Q/K/V, applies RoPE at each token's position, then hands
the paged write-and-attend to the ragged paged attention that `agentjax.kernels` picks (the jnp
reference on CPU; the kernel where `ModelConfig.attention_impl` asks for it). K and V live in the
layer's slot of its KV kind (agentjax/kv_buffers.py: a buffer per kind, or cells of the pool).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx
from jaxtyping import Array, Float

from agentjax import kernels
from agentjax.config import ModelConfig
from agentjax.kv_buffers import LayerKV
from agentjax.models.layers import Linear, RMSNorm, apply_rope, rope_inverse_frequencies, yarn_attention_factor
from agentjax.models.mixer import PagedMixer

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch


def init_gqa_projections(module: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    """Give `module` the GQA projections `q_proj`, `k_proj`, `v_proj`, `o_proj` and, where the config asks,
    the per-head `q_norm` and `k_norm` (the checkpoint names of every GQA layer)."""
    hidden, dim = cfg.hidden_size, cfg.head_dim
    module.q_proj = Linear(hidden, cfg.num_heads * dim, dtype=cfg.dtype, rngs=rngs)
    module.k_proj = Linear(hidden, cfg.num_kv_heads * dim, dtype=cfg.dtype, rngs=rngs)
    module.v_proj = Linear(hidden, cfg.num_kv_heads * dim, dtype=cfg.dtype, rngs=rngs)
    module.o_proj = Linear(cfg.num_heads * dim, hidden, dtype=cfg.dtype, rngs=rngs)
    if cfg.use_qk_norm:
        module.q_norm = RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        module.k_norm = RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
    module.use_qk_norm = cfg.use_qk_norm
    module.num_heads, module.num_kv_heads, module.head_dim = cfg.num_heads, cfg.num_kv_heads, dim


def gqa_qkv(module: nnx.Module, x: Float[Array, "tokens hidden"], numerics: str) -> tuple[Array, Array, Array]:
    """Q, K and V `[tokens, heads, dim]` of a module set up by `init_gqa_projections`, normed, not rotated."""
    tokens = x.shape[0]
    q = module.q_proj(x, numerics).reshape(tokens, module.num_heads, module.head_dim)
    k = module.k_proj(x, numerics).reshape(tokens, module.num_kv_heads, module.head_dim)
    v = module.v_proj(x, numerics).reshape(tokens, module.num_kv_heads, module.head_dim)
    if module.use_qk_norm:
        q, k = module.q_norm(q, numerics), module.k_norm(k, numerics)
    return q, k, v


class Attention(PagedMixer):
    """One layer's GQA attention; `layer` fixes its window, RoPE base and scaling."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_groups: dict[str, int], *, rngs: nnx.Rngs):
        init_gqa_projections(self, cfg, rngs)
        self.rope_dim = cfg.rope_dim
        self.sliding_window = cfg.layer_window(layer)
        self.rope_theta = cfg.layer_rope_theta(layer)
        self.rope_scaling = cfg.layer_rope_scaling(layer)
        self.sm_scale = cfg.query_scale
        self.impl = cfg.attention_impl
        self.kv_kinds = dict(kv_groups)
        self.fp8_kv = cfg.kv_cache_dtype == "fp8"  # pages of FP8 rows (pallas_kernels/kv_fp8.py)

    def project(self, x: Float[Array, "tokens hidden"], batch: RaggedBatch, numerics: str):
        """Q, K and V of the batch's tokens, normed and rotated: `[tokens, heads, dim]` each."""
        q, k, v = gqa_qkv(self, x, numerics)
        inv_freq = rope_inverse_frequencies(self.rope_dim, self.rope_theta, self.rope_scaling)
        scale = yarn_attention_factor(self.rope_scaling)
        return (apply_rope(q, batch.positions, inv_freq, scale), apply_rope(k, batch.positions, inv_freq, scale), v)

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        tokens, batch = x.shape[0], paged.batch
        q, k, v = self.project(x, batch, numerics)
        out, pages = kernels.ragged_paged_attention(
            q,
            k,
            v,
            paged.pages("kv"),
            batch.kv_lens,
            paged.table("kv"),
            batch.cu_q_lens,
            layer=paged.layer("kv"),
            **paged.token_fields("kv"),
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window,
            batch_invariant=numerics == "batch_invariant",
            impl=self.impl,
            fp8_kv=self.fp8_kv,
        )
        paged.store("kv", pages)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), numerics)
