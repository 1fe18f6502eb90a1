"""Multi-token-prediction (MTP) modules held in the Decoder (MiniMax-M3's and DeepSeek-V4's;
`mtp_module` picks by config), and their forward for speculative decoding's "mtp" method.

One module predicts the token after next from the main model's final hidden state h (after its
final norm) and the embedding e of the next token (zeroed at position 0), as vLLM's MiniMaxM3MTP
does: `z = eh_proj([enorm(e), hnorm(h)])`, `z = block(z)` (a block-sparse attention + MoE decoder
layer with its residuals), `logits = lm_head(final_norm(z))`, sharing the embedding and LM head.
With `ModelConfig.mtp_kv_cache` (set when the engine drafts with it) the module's layer, numbered
`num_layers + index`, has KV tensors of its own (slots in the model's KV groups,
agentjax/kv/cache_layout.py); without it its layer has no KV group and the module cannot run.

DeepSeek-V4's module (vLLM's DeepSeekV4MultiTokenPredictorLayer) reads the main model's residual
streams before its hyper-head: `z_n = h_proj(hnorm(h_n)) + e_proj(enorm(e))` for every stream n (e
zeroed at position 0), then a sliding-window-only DeepSeek-V4 layer with a learned-router MoE and its
own mHC, its own hyper-head, `final_norm` and the shared LM head.

`run(e, h, kv, batch)` returns the block's output (what a chained draft step feeds back as h: the
pre-norm hidden state, or the streams) and the normed hidden state the LM head reads.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax.config import ModelConfig
from agentjax.errors import ModelConfigError
from agentjax.models.decoder_block import DecoderBlock
from agentjax.models.layer_plan import LayerKind
from agentjax.models.layers import Linear, RMSNorm
from agentjax.models.residual import HyperHead

# The MiniMax-M3 MTP layer's KV roles (DeepSeek-V4's are those of a swa_mqa layer).
MTP_KV_ROLES = ("index", "kv")


def mtp_kv_groups(cfg: ModelConfig, index: int, roles) -> tuple[tuple[str, int], ...]:
    """(role, KV group) of MTP module `index`'s layer: its groups with `mtp_kv_cache`, else -1 (none)."""
    if not cfg.mtp_kv_cache:
        return tuple(sorted((role, -1) for role in roles))
    return tuple(sorted((role, group) for role, (group, _) in mtp_kv_slots(cfg, index).items()))


def mtp_kv_slots(cfg: ModelConfig, index: int) -> dict[str, tuple[int, int]]:
    """Role -> (KV group, slot) of MTP module `index`'s layer (a model with `mtp_kv_cache`)."""
    from agentjax.kv.cache_layout import kv_slots

    layer = cfg.num_layers + index
    return {role: place for (owner, role), place in kv_slots(cfg).items() if owner == layer}


def mtp_layer_kind(cfg: ModelConfig, index: int = 0) -> LayerKind:
    """The MTP decoder layer: always block-sparse attention and MoE (vLLM's force_sparse_attn/force_moe)."""
    if cfg.block_sparse is None or cfg.moe is None:
        raise ModelConfigError(
            f"num_mtp_modules={cfg.num_mtp_modules} needs the block_sparse and moe configs "
            f"(an MTP layer is block-sparse attention + MoE); model {cfg.name!r} lacks "
            f"{'block_sparse' if cfg.block_sparse is None else 'moe'}"
        )
    return LayerKind("block_sparse_attention", "moe", None, (cfg.rope_theta, cfg.rope_scaling),
                     mtp_kv_groups(cfg, index, MTP_KV_ROLES))


def hyper_connected_mtp_layer_kind(cfg: ModelConfig, index: int = 0) -> LayerKind:
    """DeepSeek-V4's MTP layer: the sliding-window-only mixer ("swa_mqa") and a learned-router MoE,
    its KV roles those of a swa_mqa layer."""
    from agentjax.kv.cache_layout import kv_tensors

    if cfg.compressed_attention is None or cfg.moe is None:
        raise ModelConfigError(
            f"num_mtp_modules={cfg.num_mtp_modules} with hyper_connections needs the compressed_attention and moe "
            f"configs (a DeepSeek-V4 MTP layer is swa_mqa attention + MoE); model {cfg.name!r} lacks "
            f"{'compressed_attention' if cfg.compressed_attention is None else 'moe'}")
    single = cfg.replace(num_layers=1, layer_types=("swa_mqa",), mlp_layer_types=("moe",), num_mtp_modules=0,
                         mtp_kv_cache=False)
    roles = [tensor.role for tensor in kv_tensors(single)]
    return LayerKind("swa_mqa", "moe", cfg.sliding_window, (cfg.rope_theta, None), mtp_kv_groups(cfg, index, roles))


def _through_block(module: nnx.Module, x, kv: tuple, batch, numerics: str) -> tuple:
    """`(x, kv)` after an MTP module's decoder block, at its layer number and KV slots."""
    slots = {role: jnp.asarray(slot, jnp.int32) for role, slot in module.slot_table}
    return module.block(x, kv, batch, numerics, slots, jnp.asarray(module.layer, jnp.int32))


def _slot_table(cfg: ModelConfig, index: int) -> tuple[tuple[str, int], ...]:
    """(role, slot) of MTP module `index`'s layer as static ints (none without `mtp_kv_cache`)."""
    if not cfg.mtp_kv_cache:
        return ()
    return tuple(sorted((role, slot) for role, (_, slot) in mtp_kv_slots(cfg, index).items()))


def mtp_module(cfg: ModelConfig, index: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """The model's MTP module `index`: DeepSeek-V4's when the residual has hyper-connections, else MiniMax-M3's."""
    if cfg.hyper_connections is not None:
        return HyperConnectedMTPModule(cfg, index, rngs=rngs)
    return MTPModule(cfg, index, rngs=rngs)


class MTPModule(nnx.Module):
    """Parameters `enorm`, `hnorm`, `eh_proj` [2H, H], `block` (input_norm, attn, pre_mlp_norm, mlp)
    and `final_norm`; checkpoint names `mtp.{index}.<...>`."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.hnorm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.eh_proj = Linear(2 * hidden, hidden, dtype=cfg.dtype, rngs=rngs)
        self.block = DecoderBlock(cfg, cfg.num_layers + index, mtp_layer_kind(cfg, index), rngs=rngs)
        self.final_norm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.layer, self.slot_table = cfg.num_layers + index, _slot_table(cfg, index)

    def run(self, embeddings: Float[Array, "tokens hidden"], hidden: Float[Array, "tokens hidden"], kv: tuple,
            batch, numerics: str = "fast") -> tuple[Array, Float[Array, "tokens hidden"], tuple]:
        """`(block output, normed hidden for the LM head, kv)` for the batch's tokens."""
        z = self.combine(embeddings, hidden, batch.positions, numerics)
        z, kv = _through_block(self, z, kv, batch, numerics)
        return z, self.final_norm(z, numerics), kv

    def combine(
        self,
        embeddings: Float[Array, "tokens hidden"],
        hidden: Float[Array, "tokens hidden"],
        positions: Int[Array, " tokens"],
        numerics: str = "fast",
    ) -> Float[Array, "tokens hidden"]:
        """The block's input: `eh_proj([enorm(e), hnorm(h)])`, with e zeroed at position 0."""
        embeddings = jnp.where((positions == 0)[:, None], 0, embeddings)
        joined = jnp.concatenate([self.enorm(embeddings, numerics), self.hnorm(hidden, numerics)], axis=-1)
        return self.eh_proj(joined, numerics)


class HyperConnectedMTPModule(nnx.Module):
    """DeepSeek-V4's MTP module: `enorm`, `hnorm`, `e_proj` [H, H], `h_proj` [H, H], `block` (a DecoderBlock
    with its mHC residual), `hc_head` (its own hyper-head) and `final_norm`; checkpoint names
    `mtp.{index}.<...>` (upstream `mtp.{k}.{enorm,hnorm,e_proj,h_proj,norm,hc_head_*,attn,ffn,...}`)."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs):
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.hnorm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.e_proj = Linear(hidden, hidden, dtype=cfg.dtype, rngs=rngs)
        self.h_proj = Linear(hidden, hidden, dtype=cfg.dtype, rngs=rngs)
        self.block = DecoderBlock(cfg, cfg.num_layers + index, hyper_connected_mtp_layer_kind(cfg, index), rngs=rngs)
        self.hc_head = HyperHead(cfg, rngs=rngs)
        self.final_norm = RMSNorm(hidden, eps=eps, dtype=cfg.dtype)
        self.layer, self.slot_table = cfg.num_layers + index, _slot_table(cfg, index)

    def run(self, embeddings: Float[Array, "tokens hidden"], streams: Float[Array, "tokens n hidden"], kv: tuple,
            batch, numerics: str = "fast") -> tuple[Array, Float[Array, "tokens hidden"], tuple]:
        """`(output streams, normed hidden for the LM head, kv)` for the batch's tokens."""
        z = self.combine(embeddings, streams, batch.positions, numerics)
        tokens, n, _ = z.shape
        stream = (z, jnp.zeros((tokens, n), jnp.float32), jnp.zeros((tokens, n, n), jnp.float32))
        stream, kv = _through_block(self, stream, kv, batch, numerics)
        return stream[0], self.final_norm(self.hc_head.finish(stream, numerics), numerics), kv

    def combine(
        self,
        embeddings: Float[Array, "tokens hidden"],
        streams: Float[Array, "tokens n hidden"],
        positions: Int[Array, " tokens"],
        numerics: str = "fast",
    ) -> Float[Array, "tokens n hidden"]:
        """The block's input streams: `h_proj(hnorm(h_n)) + e_proj(enorm(e))`, with e zeroed at position 0."""
        tokens, n, hidden = streams.shape
        embeddings = jnp.where((positions == 0)[:, None], 0, embeddings)
        projected = self.h_proj(self.hnorm(streams.reshape(tokens * n, hidden), numerics), numerics)
        return projected.reshape(tokens, n, hidden) + self.e_proj(self.enorm(embeddings, numerics), numerics)[:, None]
