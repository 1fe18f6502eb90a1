"""Multi-head latent attention as Kimi does it (NoPE, one latent row per token), over the paged cache.

Each token's hidden state gives a query per head (directly, or through the q LoRA with its norm) and
one shared row `[c | k_rot]`: `c` the RMS-normed KV latent, `k_rot` the "rope" part, unrotated in
Kimi and shared by all heads. Only that row is cached (K and V both come from it). Attention runs in
the absorbed form for every token: `W_UK` (the key half of `kv_b_proj`) folds into the query, the
kernel (`agentjax.kernels.mla_paged_attention`) attends over the latent rows, and `W_UV` (the value
half) maps the latent result to each head's value. Kimi-K3 gates the heads' output with
`sigmoid(g_proj(x))` before `o_proj`. One formulation for all tokens, so "batch_invariant" numerics
hold across batching, chunking and caching. Never reads another layer's KV slot.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from agentjax import kernels
from agentjax.config import ModelConfig
from agentjax.errors import UnsupportedModelError
from agentjax.kv_buffers import LayerKV
from agentjax.models.layers import Linear, RMSNorm, map_row_blocks
from agentjax.models.mixer import PagedMixer

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch


def _per_token(fn, numerics: str, *arrays: Array) -> Array:
    """`fn(*arrays)` over token rows; in "batch_invariant" numerics over fixed blocks of rows."""
    return map_row_blocks(fn, *arrays) if numerics == "batch_invariant" else fn(*arrays)


class MLAAttention(PagedMixer):
    """One layer's MLA. Parameters keep transformers' Kimi names (`q_proj` or `q_a_proj`,
    `q_a_layernorm`, `q_b_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; `g_proj` for
    the K3 output gate; `o_proj`), kernels stored [in, out]."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_groups: dict[str, int], *, rngs: nnx.Rngs):
        mla = cfg.mla
        if mla.use_rope:
            raise UnsupportedModelError(f"layer {layer}: MLA with RoPE is not supported (Kimi's MLA uses none)")
        hidden, heads, dtype = cfg.hidden_size, cfg.num_heads, cfg.dtype
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, dtype=dtype, rngs=rngs)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps=mla.norm_eps, dtype=dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_width, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps=mla.norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                dtype=dtype, rngs=rngs)
        if mla.output_gate:
            self.g_proj = Linear(hidden, heads * mla.v_head_dim, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, dtype=dtype, rngs=rngs)
        self.mla = mla
        self.num_heads = heads
        self.sm_scale = cfg.attention_scale if cfg.attention_scale is not None else mla.qk_head_dim**-0.5
        self.impl = cfg.attention_impl
        self.kv_kinds = dict(kv_groups)
        self.fp8_kv = cfg.kv_cache_dtype == "fp8"  # pages of FP8 rows (pallas_kernels/kv_fp8.py)

    def queries(self, x: Float[Array, "tokens hidden"], numerics: str) -> Float[Array, "tokens heads qk"]:
        if self.mla.q_lora_rank is None:
            q = self.q_proj(x, numerics)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, numerics), numerics), numerics)
        return q.reshape(x.shape[0], self.num_heads, self.mla.qk_head_dim)

    def latent_rows(self, x: Float[Array, "tokens hidden"], numerics: str) -> Float[Array, "tokens width"]:
        """The cached row of each token: the normed latent, then the (unrotated) shared rope part."""
        compressed = self.kv_a_proj_with_mqa(x, numerics)
        rank = self.mla.kv_lora_rank
        return jnp.concatenate([self.kv_a_layernorm(compressed[:, :rank], numerics), compressed[:, rank:]], axis=-1)

    def up_projections(self) -> tuple[Array, Array]:
        """`W_UK [rank, heads, nope]` and `W_UV [rank, heads, v]`: the two halves of `kv_b_proj`."""
        mla = self.mla
        kernel = self.kv_b_proj.kernel[...].reshape(mla.kv_lora_rank, self.num_heads,
                                                    mla.qk_nope_head_dim + mla.v_head_dim)
        return kernel[..., :mla.qk_nope_head_dim], kernel[..., mla.qk_nope_head_dim:]

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        mla, tokens = self.mla, x.shape[0]
        q = self.queries(x, numerics)
        w_uk, w_uv = self.up_projections()

        def absorb(q_rows: Array) -> Array:
            q_latent = jnp.einsum("thn,rhn->thr", q_rows[..., :mla.qk_nope_head_dim], w_uk)
            return jnp.concatenate([q_latent, q_rows[..., mla.qk_nope_head_dim:]], axis=-1)

        out_latent, pages = kernels.mla_paged_attention(
            _per_token(absorb, numerics, q),
            self.latent_rows(x, numerics),
            paged.pages("latent"),
            paged.table("latent"),
            layer=paged.layer("latent"),
            **paged.token_fields("latent"),
            kv_lens=paged.batch.kv_lens,
            cu_q_lens=paged.batch.cu_q_lens,
            value_dim=mla.kv_lora_rank,
            sm_scale=self.sm_scale,
            batch_invariant=numerics == "batch_invariant",
            impl=self.impl,
            fp8_kv=self.fp8_kv,
        )
        out = _per_token(lambda rows: jnp.einsum("thr,rhv->thv", rows, w_uv), numerics, out_latent)
        if mla.output_gate:
            gate = self.g_proj(x, numerics).reshape(tokens, self.num_heads, mla.v_head_dim)
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        paged.store("latent", pages)
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim), numerics)
