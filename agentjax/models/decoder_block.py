"""One decoder layer (`DecoderBlock`): a token mixer and a feed-forward block, picked per layer kind from
their registries (`MIXERS`, `make_mlp`), joined to the residual stream as the model's topology says.

The decoder (agentjax/models/decoder.py) stacks them into segments; MTP modules (mtp.py) hold one each.
Pure functions of their inputs: no global state.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from agentjax.config import ModelConfig
from agentjax.models.layer_plan import LayerKind
from agentjax.models.layers import GatedMLP, RMSNorm
from agentjax.models.moe import MoE
from agentjax.models.residual import layer_residual

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch

# Token mixers by layer type. Each is built as `cls(cfg, layer, kv_groups, rngs=...)` and called as
# `mixer(x, kv, batch, numerics, slots) -> (out, kv)`, where `kv` is the KV memory (a tuple of per-kind
# buffers or a KVPool, agentjax/kv_buffers.py) and `slots` maps each of its KV roles to its (traced)
# slot among its kind's layers.
MIXERS = {
    "full_attention": "agentjax.models.attention:Attention",
    "sliding_attention": "agentjax.models.attention:Attention",
    "block_sparse_attention": "agentjax.models.block_sparse:BlockSparseAttention",
    "mla": "agentjax.models.mla:MLAAttention",
    "kda": "agentjax.models.kda:KimiDeltaAttention",
    "swa_mqa": "agentjax.models.dsv4_attention:SlidingWindowMQA",
    "csa": "agentjax.models.dsv4_attention:CompressedSparseAttention",
    "hca": "agentjax.models.dsv4_attention:HeavilyCompressedAttention",
}


def _resolve(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def real_token_mask(batch: RaggedBatch) -> Array:
    """[tokens] bool: True where a token lies in its row's new tokens (positions kv_len - q_len .. kv_len - 1),
    False for a shape bucket's padding. Per token, so it holds for a rank's tokens under PCP too; a padding
    token that happens to fall in a real row's range (row B-1 prefilling from position 0) counts as real,
    which costs work but never changes a real token."""
    rows = batch.seq_ids
    new_tokens = batch.cu_q_lens[rows + 1] - batch.cu_q_lens[rows]
    end = batch.kv_lens[rows]
    return (batch.positions >= end - new_tokens) & (batch.positions < end)


def make_mlp(cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs) -> nnx.Module:
    """The feed-forward block of a layer: a gated MLP, or a mixture of experts (routed by its router,
    or by a token-id table for "hash_moe"). Each is called as `mlp(x, numerics, token_ids=..., real_tokens=...)`."""
    if kind in ("moe", "hash_moe"):
        table_rows = cfg.vocab_size if kind == "hash_moe" else None
        return MoE(cfg.hidden_size, cfg.moe, dtype=cfg.dtype, rngs=rngs, hash_table_rows=table_rows,
                   impl=cfg.attention_impl)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, dtype=cfg.dtype, rngs=rngs,
                    swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
                    situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)


class DecoderBlock(nnx.Module):
    """Pre-norm token mixer and feed-forward blocks; Gemma adds a norm after each block too.

    The residual stream's topology (agentjax/models/residual.py) decides what the mixer and the MLP
    read and how their outputs join the stream: plain pre-norm, or Kimi-K3's block attention residuals.
    """

    def __init__(self, cfg: ModelConfig, layer: int, kind: LayerKind, *, rngs: nnx.Rngs):
        eps, dtype = cfg.rms_norm_eps, cfg.dtype
        self.input_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.attn = _resolve(MIXERS[kind.mixer])(cfg, layer, dict(kind.kv_groups), rngs=rngs)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.mlp = make_mlp(cfg, kind.mlp, rngs=rngs)
        self.routes_tokens = kind.mlp in ("moe", "hash_moe")
        if cfg.use_sandwich_norms:
            self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.sandwich = cfg.use_sandwich_norms
        self.residual = layer_residual(cfg, rngs=rngs)

    def __call__(self, stream, kv: tuple, batch: RaggedBatch, numerics: str,
                 slots: dict[str, Array], layer: Array, with_stats: bool = False):
        """One layer on the residual `stream`; `layer` is the (traced) layer index. Returns `(stream, kv)`,
        with `with_stats` `(stream, kv, routed pairs)` (0 for a dense MLP)."""
        stream, x = self.residual.mixer_input(stream, layer, numerics)
        attn_out, kv = self.attn(self.input_norm(x, numerics), kv, batch, numerics, slots)
        # The KV buffers leave each layer only once its output exists: XLA then updates them in place even
        # when several layers of one scanned body write the same buffer (else it copies the buffer).
        attn_out, kv = jax.lax.optimization_barrier((attn_out, kv))
        if self.sandwich:
            attn_out = self.post_attn_norm(attn_out, numerics)
        stream, x = self.residual.mlp_input(stream, attn_out, numerics)
        mlp_in = self.pre_mlp_norm(x, numerics)
        routed = jnp.zeros((), jnp.int32)
        if self.routes_tokens:
            mlp_out = self.mlp(mlp_in, numerics, token_ids=batch.token_ids, real_tokens=real_token_mask(batch),
                               with_stats=with_stats)
            if with_stats:
                mlp_out, routed = mlp_out
        else:
            mlp_out = self.mlp(mlp_in, numerics, token_ids=batch.token_ids)
        if self.sandwich:
            mlp_out = self.post_mlp_norm(mlp_out, numerics)
        stream = self.residual.add_mlp_output(stream, mlp_out, numerics)
        return (stream, kv, routed) if with_stats else (stream, kv)
