"""MiniMax-M3's block-sparse GQA attention layer: an indexer picks key blocks, GQA reads only those.

Q/K/V as in `Attention` (per-head QK norm, then partial RoPE); the indexer's own projections give
`index_num_heads` query heads and one key head (normed, then rotated with the same RoPE), whose
keys live in the layer's slot of the "index" KV group. The indexer keeps, per indexer head (one
per KV head), the top-k blocks of `block_size` positions by block-max score with the local blocks
forced; attention then reads only those blocks. The paged work goes through `agentjax.kernels`.
This module never touches pages directly and imports nothing from a kernel file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx
from jaxtyping import Array, Float

from agentjax import kernels
from agentjax.config import ModelConfig
from agentjax.kv_buffers import LayerKV
from agentjax.models.attention import gqa_qkv, init_gqa_projections
from agentjax.models.layers import Linear, RMSNorm, apply_rope, rope_inverse_frequencies, yarn_attention_factor
from agentjax.models.mixer import PagedMixer

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch


class BlockSparseAttention(PagedMixer):
    """One block-sparse layer. Its settings come from `cfg` alone (equal for every sparse layer), so
    `layer` may also name a layer outside the stack (an MTP module's)."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_groups: dict[str, int], *, rngs: nnx.Rngs):
        del layer  # every block-sparse layer is alike
        sparse = cfg.block_sparse
        hidden = cfg.hidden_size
        init_gqa_projections(self, cfg, rngs)
        index_dim = sparse.index_head_dim
        self.index_q_proj = Linear(hidden, sparse.index_num_heads * index_dim, dtype=cfg.dtype, rngs=rngs)
        self.index_k_proj = Linear(hidden, index_dim, dtype=cfg.dtype, rngs=rngs)
        self.index_q_norm = RMSNorm(index_dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.index_k_norm = RMSNorm(index_dim, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.index_num_heads, self.index_head_dim = sparse.index_num_heads, index_dim
        self.block_size, self.topk_blocks = sparse.block_size, sparse.topk_blocks
        self.local_blocks = sparse.local_blocks
        self.rope_dim, self.rope_theta, self.rope_scaling = cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling
        self.sm_scale = cfg.query_scale
        self.impl = cfg.attention_impl
        self.kv_kinds = dict(kv_groups)
        self.fp8_kv = cfg.kv_cache_dtype == "fp8"  # K/V pages of FP8 rows; the indexer keys stay in the model dtype

    def project(self, x: Float[Array, "tokens hidden"], batch: RaggedBatch, numerics: str):
        """Q, K, V `[tokens, heads, dim]` and the indexer's queries `[tokens, index_heads, index_dim]`
        and keys `[tokens, index_dim]`, normed and rotated."""
        tokens = x.shape[0]
        q, k, v = gqa_qkv(self, x, numerics)
        index_q = self.index_q_proj(x, numerics).reshape(tokens, self.index_num_heads, self.index_head_dim)
        index_q = self.index_q_norm(index_q, numerics)
        index_k = self.index_k_norm(self.index_k_proj(x, numerics), numerics)[:, None, :]
        inv_freq = rope_inverse_frequencies(self.rope_dim, self.rope_theta, self.rope_scaling)
        positions, scale = batch.positions, yarn_attention_factor(self.rope_scaling)

        def rope(t: Array) -> Array:
            return apply_rope(t, positions, inv_freq, scale)

        return rope(q), rope(k), v, rope(index_q), rope(index_k)[:, 0]

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        tokens, batch = x.shape[0], paged.batch
        q, k, v, index_q, index_k = self.project(x, batch, numerics)
        invariant = numerics == "batch_invariant"
        selected, index_pages = kernels.index_select_blocks(
            index_q,
            index_k,
            paged.pages("index"),
            paged.table("index"),
            slot=paged.layer("index"),
            **paged.token_fields("index"),
            block_size=self.block_size,
            topk_blocks=self.topk_blocks,
            local_blocks=self.local_blocks,
            kv_lens=batch.kv_lens,
            cu_q_lens=batch.cu_q_lens,
            batch_invariant=invariant,
            impl=self.impl,
        )
        paged.store("index", index_pages)
        out, pages = kernels.block_sparse_attention(
            q,
            k,
            v,
            paged.pages("kv"),
            paged.table("kv"),
            selected,
            slot=paged.layer("kv"),
            **paged.token_fields("kv"),
            sm_scale=self.sm_scale,
            block_size=self.block_size,
            batch_invariant=invariant,
            impl=self.impl,
            fp8_kv=self.fp8_kv,
        )
        paged.store("kv", pages)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), numerics)
