"""The decoder-only transformer as a Flax NNX module, for every family agentjax serves.

`Decoder.__call__` runs one ragged batch: embeds its tokens, runs every layer (each reads and
writes its KV groups' buffers) and returns final hidden states plus the updated KV buffers.
Layers are `DecoderBlock`s (agentjax/models/decoder_block.py: a token mixer and a feed-forward block, picked per layer kind from
registries); runs of them form `Segment`s (agentjax/models/layer_plan.py) whose parameters carry
a leading `[repeats]` axis and run under `lax.scan`, so a step compiles one body per period
position. `Decoder.logits` turns chosen hidden states into vocabulary logits. Bucket padding tokens
reach no expert of an MoE layer (`real_token_mask`); `Decoder.forward_with_stats` also returns how
many token-expert pairs each layer sent to its experts. Pure functions of their inputs: no global
state, so `jax.jit`, `jax.grad` and `jax.vmap` apply.
"""
from __future__ import annotations

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
from agentjax.models.decoder_block import DecoderBlock
from agentjax.models.layers import RMSNorm, _init
from agentjax.models.mtp import mtp_module
from agentjax.models.residual import residual_stream

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch

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
