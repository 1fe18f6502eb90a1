"""The decoder-only transformer (llama and gemma3 families) as a Flax NNX module.

`Decoder.__call__` runs one ragged batch: embeds its tokens, runs every layer (each reads and
writes its slice of the paged KV buffer) and returns final hidden states plus the updated pages.
The layers are one `LayerStack`: their parameters carry a leading layer axis and run under
`lax.scan`, so a step compiles one layer body instead of every layer unrolled.
`Decoder.logits` turns chosen hidden states into vocabulary logits. Pure functions of their
inputs: no global state, so `jax.jit`, `jax.grad` and `jax.vmap` apply.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from agentjax.config import ModelConfig
from agentjax.models.attention import Attention
from agentjax.models.layers import GatedMLP, RMSNorm, _init, dense, rope_inverse_frequencies

if TYPE_CHECKING:
    from agentjax.runner.batch import RaggedBatch


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks; Gemma adds a norm after each block too."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        eps, dtype = cfg.rms_norm_eps, cfg.dtype
        self.input_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype, rngs=rngs)
        if cfg.use_sandwich_norms:
            self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.sandwich = cfg.use_sandwich_norms

    def __call__(self, x: Array, kv_pages: Array, batch: RaggedBatch, numerics: str,
                 **layer_settings: Array) -> tuple[Array, Array]:
        attn_out, kv_pages = self.attn(self.input_norm(x, numerics), kv_pages, batch, numerics, **layer_settings)
        if self.sandwich:
            attn_out = self.post_attn_norm(attn_out, numerics)
        x = x + attn_out
        mlp_out = self.mlp(self.pre_mlp_norm(x, numerics), numerics)
        if self.sandwich:
            mlp_out = self.post_mlp_norm(mlp_out, numerics)
        return x + mlp_out, kv_pages


# Stands for "no window" in a stack that mixes sliding and full-attention layers.
_NO_WINDOW = 2**30


class LayerStack(nnx.Module):
    """Every decoder layer as one module whose parameters have a leading `[num_layers]` axis.

    Layers differ only in static settings (window, RoPE base and scaling, index), which become
    per-layer arrays scanned beside the parameters.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        layers = [DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)]
        graphdef, _ = nnx.split(layers[0])
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(layer) for layer in layers))
        self.block = nnx.merge(graphdef, stacked)
        self.num_layers = cfg.num_layers
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        self.windows = None if all(w is None for w in windows) else tuple(w or _NO_WINDOW for w in windows)
        self.rope = tuple((cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i)) for i in range(cfg.num_layers))
        self.head_dim = cfg.head_dim

    def __call__(self, x: Array, kv_pages: Array, batch: RaggedBatch, numerics: str) -> tuple[Array, Array]:
        graphdef, stacked = nnx.split(self.block)
        per_layer = {
            "layer": jnp.arange(self.num_layers, dtype=jnp.int32),
            "inv_freq": jnp.stack([rope_inverse_frequencies(self.head_dim, theta, scaling)
                                   for theta, scaling in self.rope]),
        }
        if self.windows is not None:
            per_layer["sliding_window"] = jnp.asarray(self.windows, jnp.int32)

        def body(carry, scanned):
            x, kv_pages = carry
            state, settings = scanned
            x, kv_pages = nnx.merge(graphdef, state)(x, kv_pages, batch, numerics, **settings)
            return (x, kv_pages), None

        (x, kv_pages), _ = jax.lax.scan(body, (x, kv_pages), (stacked, per_layer))
        return x, kv_pages


class Decoder(nnx.Module):
    """Embeddings, the layer stack, the final norm and the (tied or separate) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.dtype, scale=0.02))
        self.layers = LayerStack(cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.dtype))
        self.tied = cfg.tie_word_embeddings
        self.embedding_multiplier = cfg.embedding_multiplier
        self.final_logit_softcap = cfg.final_logit_softcap

    def __call__(
        self,
        kv_pages: Float[Array, "layers pages page_size kv2 dim"],
        batch: RaggedBatch,
        numerics: str = "fast",
    ) -> tuple[Float[Array, "tokens hidden"], Float[Array, "layers pages page_size kv2 dim"]]:
        x = jnp.take(self.embed[...], batch.token_ids, axis=0)
        if self.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.embedding_multiplier, x.dtype)
        x, kv_pages = self.layers(x, kv_pages, batch, numerics)
        return self.final_norm(x, numerics), kv_pages

    def logits(self, hidden: Float[Array, "rows hidden"], numerics: str = "fast") -> Float[Array, "rows vocab"]:
        kernel = self.embed[...].T if self.tied else self.lm_head[...]
        logits = dense(hidden, kernel, numerics).astype(jnp.float32)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        return logits
