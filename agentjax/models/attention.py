"""GQA attention over the paged KV cache, with per-layer sliding windows and Gemma's QK norms.

Projects the ragged batch's tokens to Q/K/V, applies RoPE at each token's position, then hands
the paged write-and-attend to the ragged paged attention of `pallas_kernels` (the jnp reference
on CPU; the kernel where `ModelConfig.attention_impl` asks for it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx
from jaxtyping import Array, Float

from agentjax.config import ModelConfig
from agentjax.models.layers import Linear, RMSNorm, apply_rope, rope_inverse_frequencies
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

if TYPE_CHECKING:
    from agentjax.runner.batch import RaggedBatch


class Attention(nnx.Module):
    """One layer's attention. `layer` fixes its window, RoPE base and scaling."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        hidden, dim = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(hidden, cfg.num_heads * dim, dtype=cfg.dtype, rngs=rngs)
        self.k_proj = Linear(hidden, cfg.num_kv_heads * dim, dtype=cfg.dtype, rngs=rngs)
        self.v_proj = Linear(hidden, cfg.num_kv_heads * dim, dtype=cfg.dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * dim, hidden, dtype=cfg.dtype, rngs=rngs)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
            self.k_norm = RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.use_qk_norm = cfg.use_qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, dim
        self.sliding_window = cfg.layer_window(layer)
        self.rope_theta = cfg.layer_rope_theta(layer)
        self.rope_scaling = cfg.layer_rope_scaling(layer)
        self.sm_scale = cfg.query_scale
        self.impl = cfg.attention_impl
        self.layer = layer

    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        kv_pages: Float[Array, "layers pages page_size kv2 dim"],
        batch: RaggedBatch,
        numerics: str,
        layer: Array | None = None,
        sliding_window: Array | None = None,
        inv_freq: Array | None = None,
    ) -> tuple[Float[Array, "tokens hidden"], Float[Array, "layers pages page_size kv2 dim"]]:
        """`layer`, `sliding_window` and `inv_freq`, when given (traced, from a layer scan), replace
        this module's own per-layer settings."""
        tokens = x.shape[0]
        q = self.q_proj(x, numerics).reshape(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x, numerics).reshape(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, numerics).reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q, numerics), self.k_norm(k, numerics)
        if inv_freq is None:
            inv_freq = rope_inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        q = apply_rope(q, batch.positions, inv_freq)
        k = apply_rope(k, batch.positions, inv_freq)
        if self.impl != "reference":
            raise NotImplementedError(
                f"attention_impl={self.impl!r}: only the 'reference' ragged paged attention exists so far"
            )
        out, kv_pages = ragged_paged_attention(
            q,
            k,
            v,
            kv_pages,
            batch.kv_lens,
            batch.page_indices,
            batch.cu_q_lens,
            layer=self.layer if layer is None else layer,
            token_seq_ids=batch.seq_ids,
            token_positions=batch.positions,
            slot_mapping=batch.slot_mapping,
            sm_scale=self.sm_scale,
            sliding_window=self.sliding_window if sliding_window is None else sliding_window,
            batch_invariant=numerics == "batch_invariant",
        )
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), numerics), kv_pages
