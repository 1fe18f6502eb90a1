"""The decoder-only transformer as a Flax NNX module, for every family agentjax serves.

`Decoder.__call__` runs one ragged batch: embeds its tokens, runs every layer (each reads and
writes its KV groups' buffers) and returns final hidden states plus the updated KV buffers.
Layers are `DecoderBlock`s (a token mixer and a feed-forward block, picked per layer kind from
registries); runs of them form `Segment`s (agentjax/models/layer_plan.py) whose parameters carry
a leading `[repeats]` axis and run under `lax.scan`, so a step compiles one body per period
position. `Decoder.logits` turns chosen hidden states into vocabulary logits. Bucket padding tokens
reach no expert of an MoE layer (`real_token_mask`); `Decoder.forward_with_stats` also returns how
many token-expert pairs each layer sent to its experts. Pure functions of their inputs: no global
state, so `jax.jit`, `jax.grad` and `jax.vmap` apply.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax.config import ModelConfig
from agentjax.kv.cache_layout import kv_slots
from agentjax.kv_buffers import KVPool, num_page_tables
from agentjax.models.layer_plan import LayerKind, Segment, layer_kinds, segment_slot_table, segments_of
from agentjax.models.block_weights import project, take_rows
from agentjax.models.layers import GatedMLP, RMSNorm, _init
from agentjax.models.residual import layer_residual, residual_stream

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
        from agentjax.models.moe import MoE

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


class SegmentStack(nnx.Module):
    """One segment: a block per period position, each with parameters stacked over the repeats."""

    def __init__(self, cfg: ModelConfig, segment: Segment, kinds: list[LayerKind], *, rngs: nnx.Rngs):
        blocks = []
        for position in range(segment.period):
            reps = [DecoderBlock(cfg, segment.layer(rep, position), kinds[segment.layer(rep, position)], rngs=rngs)
                    for rep in range(segment.repeats)]
            graphdef, _ = nnx.split(reps[0])
            stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(nnx.state(block) for block in reps))
            blocks.append(nnx.merge(graphdef, stacked))
        self.blocks = nnx.List(blocks)
        # Per period position: (role, slot of each repeat) as plain ints (static metadata, not parameters).
        self.slot_tables = tuple(
            tuple((role, tuple(int(s) for s in table)) for role, table in segment_slot_table(cfg, segment, p).items())
            for p in range(segment.period))
        self.layer_ids = tuple(tuple(segment.layer(rep, p) for rep in range(segment.repeats))
                               for p in range(segment.period))

    def __call__(self, stream, kv: tuple, batch: RaggedBatch, numerics: str, with_stats: bool = False):
        """`(stream, kv)`; with `with_stats` also the routed pairs of each layer, `[repeats, period]`."""
        split = [nnx.split(block) for block in self.blocks]
        slots = [{role: jnp.asarray(table, jnp.int32) for role, table in tables} for tables in self.slot_tables]
        layers = [jnp.asarray(ids, jnp.int32) for ids in self.layer_ids]

        def body(carry, scanned):
            stream, kv = carry
            routed = []
            for (graphdef, _), state, position_slots, layer in zip(split, *scanned):
                out = nnx.merge(graphdef, state)(stream, kv, batch, numerics, position_slots, layer, with_stats)
                stream, kv = out[:2]
                routed += out[2:]
            return (stream, kv), (jnp.stack(routed) if with_stats else None)

        (stream, kv), routed = jax.lax.scan(body, (stream, kv), ([state for _, state in split], slots, layers))
        return (stream, kv, routed) if with_stats else (stream, kv)


class Decoder(nnx.Module):
    """Embeddings, the layer segments, the final norm and the (tied or separate) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.dtype, scale=0.02))
        kinds = layer_kinds(cfg)
        self.segments = nnx.List([SegmentStack(cfg, segment, kinds, rngs=rngs) for segment in segments_of(cfg)])
        self.residual = residual_stream(cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.dtype))
        self.tied = cfg.tie_word_embeddings
        self.embedding_multiplier = cfg.embedding_multiplier
        self.final_logit_softcap = cfg.final_logit_softcap
        self.num_kv_groups = len({group for group, _ in kv_slots(cfg).values()})
        self.hyper_connected = cfg.hyper_connections is not None
        if cfg.num_mtp_modules:  # MTP modules (MiniMax-M3, DeepSeek-V4): run by speculative decoding's "mtp"
            from agentjax.models.mtp import mtp_module

            self.mtp = nnx.List([mtp_module(cfg, k, rngs=rngs) for k in range(cfg.num_mtp_modules)])

    def __call__(
        self,
        kv: tuple,
        batch: RaggedBatch,
        numerics: str = "fast",
    ) -> tuple[Float[Array, "tokens hidden"], tuple]:
        """`kv` is the KV memory: the tuple of per-kind buffers (`ModelConfig.new_kv_pages`; a batch with
        one page table then serves every kind with it, as notebooks do) or an engine's `KVPool`."""
        hidden, _, kv = self.forward_with_mtp_input(kv, batch, numerics)
        return hidden, kv

    def forward_with_mtp_input(self, kv: tuple, batch: RaggedBatch, numerics: str = "fast"
                               ) -> tuple[Float[Array, "tokens hidden"], Array, tuple]:
        """`(final hidden states, what an MTP module reads of each token, kv)`: the final hidden states
        themselves, or with hyper-connections the residual streams before the hyper-head."""
        hidden, mtp_input, kv, _ = self._forward(kv, batch, numerics, with_stats=False)
        return hidden, mtp_input, kv

    def forward_with_stats(self, kv: tuple, batch: RaggedBatch, numerics: str = "fast"
                           ) -> tuple[Float[Array, "tokens hidden"], tuple, Int[Array, " layers"]]:
        """`(hidden, kv, routed pairs of each layer [num_layers])`, the pairs counted in each MoE op
        (0 for a dense layer): what the experts of each layer computed for this batch."""
        hidden, _, kv, routed = self._forward(kv, batch, numerics, with_stats=True)
        return hidden, kv, routed

    def _forward(self, kv: tuple, batch: RaggedBatch, numerics: str, with_stats: bool):
        batch = batch.for_groups(num_page_tables(kv) or self.num_kv_groups)
        x = self.embed_tokens(batch.token_ids)
        kv = kv if isinstance(kv, KVPool) else tuple(kv)
        stream = self.residual.start(x)
        routed = {}
        for segment in self.segments:
            stream, kv, *stats = segment(stream, kv, batch, numerics, with_stats)
            for ids, counts in zip(segment.layer_ids, stats[0].T if stats else ()):  # per period position
                routed.update(zip(ids, counts))
        hidden = self.final_norm(self.residual.finish(stream, numerics), numerics)
        counts = jnp.stack([routed[layer] for layer in sorted(routed)]) if routed else None
        return hidden, stream[0] if self.hyper_connected else hidden, kv, counts

    def embed_tokens(self, token_ids: Array) -> Float[Array, "tokens hidden"]:
        x = take_rows(self.embed.get_value(), token_ids)
        if self.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.embedding_multiplier, x.dtype)
        return x

    def logits(self, hidden: Float[Array, "rows hidden"], numerics: str = "fast") -> Float[Array, "rows vocab"]:
        head = self.embed.get_value() if self.tied else self.lm_head.get_value()
        logits = project(hidden, head, numerics, transposed=self.tied).astype(jnp.float32)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        return logits
