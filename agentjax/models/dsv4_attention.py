"""DeepSeek-V4's attention layers (transformers 5.24.0's DeepseekV4Attention) over the paged cache.

Every layer: q LoRA (`q_b_proj(q_a_norm(q_a_proj(x)))`, then an unweighted RMSNorm per head), one
shared K=V row per token (`kv_norm(kv_proj(x))`), RoPE on the last `rotary_dim` channels in
interleaved pairs, softmax over the last `sliding_window` rows plus per-head sinks, the output rotated
back at the query position, then the grouped low-rank output projection. "csa" and "hca" layers (the
compress RoPE) also attend to compressed entries: every `rate` tokens a compressor pools its inputs
into one entry (CSA: two overlapping series over two blocks; HCA: one block), written by the step
that computes the block's last token; a CSA query reads only the `index_topk` entries its lightning
indexer scores highest. A token sees an entry only once the entry's whole block ends at or before it
(transformers' decode semantics), so a token's output never depends on later tokens, on the batch
or on the chunking. Paged work goes through `agentjax.kernels`; this module never indexes pages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax import kernels
from agentjax.config import ModelConfig, RopeScaling
from agentjax.errors import InvalidRequestError
from agentjax.kv_buffers import LayerKV
from agentjax.models.layers import Linear, RMSNorm, _init, rope_inverse_frequencies, yarn_attention_factor
from agentjax.models.mixer import PagedMixer
from agentjax.numerics import map_row_blocks

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch


def _per_token(fn, numerics: str, *arrays: Array):
    """`fn` on token rows; in "batch_invariant" numerics over fixed row blocks fenced by optimization
    barriers (a one-block loop would otherwise fuse with its neighbours into other roundings)."""
    if numerics != "batch_invariant":
        return fn(*arrays)
    return jax.lax.optimization_barrier(map_row_blocks(fn, *jax.lax.optimization_barrier(arrays)))


@dataclass(frozen=True)
class Rope:
    """DeepSeek-V4's interleaved RoPE on the last `rope_dim` channels: pairs `(x_2i, x_2i+1)` turn by
    `position * inv_freq[i]`; cos and sin carry YaRN's attention factor and the model dtype's rounding
    (transformers casts them to the activations' dtype before rotating in float32)."""

    rope_dim: int
    theta: float
    scaling: RopeScaling | None
    dtype: str

    def __call__(self, x: Float[Array, "tokens n dim"], positions: Int[Array, " tokens"],
                 inverse: bool = False) -> Float[Array, "tokens n dim"]:
        inv_freq = rope_inverse_frequencies(self.rope_dim, self.theta, self.scaling)
        factor = yarn_attention_factor(self.scaling)
        half = inv_freq.shape[0]
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        cos = (jnp.cos(angles) * factor).astype(self.dtype).astype(jnp.float32)[:, None, :]
        sin = (jnp.sin(angles) * factor).astype(self.dtype).astype(jnp.float32)[:, None, :]
        sin = -sin if inverse else sin
        keep, tail = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:].astype(jnp.float32)
        even, odd = tail[..., 0::2], tail[..., 1::2]
        rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(tail.shape)
        return jnp.concatenate([keep, rotated.astype(x.dtype)], axis=-1)


def _unweighted_rms(x: Array, eps: float) -> Array:
    """transformers' DeepseekV4UnweightedRMSNorm: `x * rsqrt(mean(x^2) + eps)`, the factor in x's dtype."""
    x32 = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps).astype(x.dtype)


class BlockCompressor(nnx.Module):
    """Pools every block of `rate` tokens into one `width`-wide entry. `series` = 2 (CSA): each token
    projects two series, and entry w mixes block w-1's first (Ca) with block w's second (Cb); 1 (HCA):
    entry w pools block w. Parameters `kv_proj`, `gate_proj` [H, series*width], `position_bias`
    [rate, series*width] (float32), `kv_norm` [width]. The entry is RMS-normed and rotated at its
    block's first position."""

    def __init__(self, hidden: int, width: int, rate: int, series: int, *, eps: float, dtype: str,
                 rngs: nnx.Rngs):
        self.kv_proj = Linear(hidden, series * width, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(hidden, series * width, dtype=dtype, rngs=rngs)
        self.position_bias = nnx.Param(_init(rngs, (rate, series * width), "float32", scale=0.5))
        self.kv_norm = RMSNorm(width, eps=eps, dtype=dtype)
        self.rate, self.series, self.dtype = rate, series, dtype

    def update(self, x: Array, paged: LayerKV, batch: RaggedBatch, numerics: str, state_role: str, entry_role: str,
               rope: Rope, impl: str) -> None:
        """Write this step's inputs into the rolling state, then the entry of every block that ends
        at one of this step's tokens (from the state of its span) into the entry pages."""
        rate, invariant = self.rate, numerics == "batch_invariant"
        inputs = jnp.concatenate([self.kv_proj(x, numerics), self.gate_proj(x, numerics)], axis=-1)
        state = kernels.dsv4_write_rows(paged.pages(state_role), paged.layer(state_role), inputs.astype(jnp.float32),
                                        paged.slot_mapping(state_role), impl=impl)
        paged.store(state_role, state)
        # At most one block ends per `rate` tokens of a row: gather those tokens (fixed count).
        tokens, rows = batch.num_tokens, batch.num_seqs
        ends = (batch.positions + 1) % rate == 0
        count = min(tokens, tokens // rate + rows)
        (token,) = jnp.nonzero(ends, size=count, fill_value=0)
        valid = jnp.arange(count) < ends.sum()
        end_positions = jnp.where(valid, batch.positions[token], 0)
        pooled = kernels.dsv4_pool_blocks(
            state, paged.layer(state_role), paged.table(state_role)[batch.seq_ids[token]], end_positions,
            self.position_bias[...], ratio=rate, overlap=self.series == 2, dtype=self.dtype,
            batch_invariant=invariant, impl=impl)
        starts = end_positions + 1 - rate
        entries = _per_token(lambda p, s: rope(self.kv_norm(p, numerics)[:, None], s)[:, 0], numerics, pooled, starts)
        # A page of P tokens holds P // rate entries: the token's slot // rate is its block's entry slot.
        entry_slots = jnp.where(valid, paged.slot_mapping(entry_role)[token] // rate, -1)
        pages = kernels.dsv4_write_entries(paged.pages(entry_role), paged.layer(entry_role), entries, entry_slots,
                                           impl=impl)
        paged.store(entry_role, pages)


class Indexer(BlockCompressor):
    """CSA's lightning indexer: a 2-series compressor of `index_head_dim`-wide keys, queries
    `q_b_proj(q_residual)` [index_heads, index_head_dim] (compress RoPE), and per-head weights
    `weights_proj(x) / sqrt(index_heads)`; a key scores `sum_h w_h relu(q_h . key) / sqrt(index_head_dim)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        attention = cfg.compressed_attention
        heads, dim = attention.index_num_heads, attention.index_head_dim
        super().__init__(cfg.hidden_size, dim, attention.csa_rate, 2, eps=cfg.rms_norm_eps, dtype=cfg.dtype,
                         rngs=rngs)
        self.q_b_proj = Linear(attention.q_lora_rank, heads * dim, dtype=cfg.dtype, rngs=rngs)
        self.weights_proj = Linear(cfg.hidden_size, heads, dtype=cfg.dtype, rngs=rngs)
        self.num_heads, self.head_dim, self.top_k = heads, dim, attention.index_topk


class GroupedLinear(nnx.Module):
    """The grouped low-rank output projection's first half: group g of the heads' outputs
    (`[heads*head_dim/groups]`) through its own `kernel[g]` [in, rank]."""

    def __init__(self, groups: int, in_features: int, rank: int, *, dtype: str, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (groups, in_features, rank), dtype, scale=in_features ** -0.5))

    def __call__(self, x: Float[Array, "tokens groups in_features"]) -> Float[Array, "tokens groups_rank"]:
        return jnp.einsum("tgi,gio->tgo", x, self.kernel[...]).reshape(x.shape[0], -1)


class DeepseekV4Attention(PagedMixer):
    """One DeepSeek-V4 layer of kind `layer_type` ("swa_mqa", "csa" or "hca"). Every setting comes
    from `cfg` and the kind, so `layer` may name a layer outside the stack (an MTP module's)."""

    layer_type: ClassVar[str] = "swa_mqa"

    def __init__(self, cfg: ModelConfig, layer: int, kv_groups: dict[str, int], *, rngs: nnx.Rngs):
        attention = cfg.compressed_attention
        if attention is None:
            raise InvalidRequestError(f"layer {layer}: a {self.layer_type} layer needs cfg.compressed_attention")
        if self.layer_type == "csa" and attention.index_head_dim < cfg.rope_dim:
            raise InvalidRequestError(f"index_head_dim={attention.index_head_dim} must be at least "
                                      f"rotary_dim={cfg.rope_dim}: the indexer rotates its last rotary_dim channels")
        hidden, dim, heads, dtype, eps = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.dtype, cfg.rms_norm_eps
        self.q_a_proj = Linear(hidden, attention.q_lora_rank, dtype=dtype, rngs=rngs)
        self.q_a_norm = RMSNorm(attention.q_lora_rank, eps=eps, dtype=dtype)
        self.q_b_proj = Linear(attention.q_lora_rank, heads * dim, dtype=dtype, rngs=rngs)
        self.kv_proj = Linear(hidden, dim, dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(dim, eps=eps, dtype=dtype)
        groups = attention.o_groups
        self.o_a_proj = GroupedLinear(groups, heads * dim // groups, attention.o_lora_rank, dtype=dtype, rngs=rngs)
        self.o_b_proj = Linear(groups * attention.o_lora_rank, hidden, dtype=dtype, rngs=rngs)
        self.sinks = nnx.Param(jnp.zeros((heads,), jnp.float32))
        compress_rope = Rope(cfg.rope_dim, attention.compress_rope_theta, attention.compress_rope_scaling, dtype)
        if self.layer_type == "swa_mqa":
            self.rope = Rope(cfg.rope_dim, cfg.rope_theta, None, dtype)
        else:
            rate, series = (attention.csa_rate, 2) if self.layer_type == "csa" else (attention.hca_rate, 1)
            self.compressor = BlockCompressor(hidden, dim, rate, series, eps=eps, dtype=dtype, rngs=rngs)
            self.rope = compress_rope
        if self.layer_type == "csa":
            self.indexer = Indexer(cfg, rngs=rngs)
        self.compress_rope = compress_rope
        self.num_heads, self.head_dim, self.groups, self.eps = heads, dim, groups, eps
        self.window, self.impl = cfg.sliding_window, cfg.attention_impl
        self.kv_kinds = dict(kv_groups)

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        groups, impl, invariant = self.kv_kinds, self.impl, numerics == "batch_invariant"
        if any(group < 0 for group in groups.values()):
            raise InvalidRequestError(f"this {self.layer_type} layer has no KV group ({groups}); it cannot run")
        tokens, heads, dim = x.shape[0], self.num_heads, self.head_dim
        batch, positions = paged.batch, paged.batch.positions
        q_residual = self.q_a_norm(self.q_a_proj(x, numerics), numerics)
        q = self.q_b_proj(q_residual, numerics).reshape(tokens, heads, dim)
        row = self.kv_norm(self.kv_proj(x, numerics), numerics)[:, None]
        q, row = _per_token(lambda q, row, p: (self.rope(_unweighted_rms(q, self.eps), p), self.rope(row, p)[:, 0]),
                            numerics, q, row, positions)
        paged.store("window", kernels.dsv4_write_rows(
            paged.pages("window"), paged.layer("window"), row, paged.slot_mapping("window"), impl=impl))
        entries = {}
        if self.layer_type != "swa_mqa":
            self.compressor.update(x, paged, batch, numerics, "kv_state", "entries", self.rope, impl)
            entries = dict(entry_pages=paged.pages("entries"), entry_slot=paged.layer("entries"),
                           entry_page_indices=paged.table("entries"), ratio=self.compressor.rate)
        if self.layer_type == "csa":
            entries["selected"] = self._select(x, q_residual, paged, batch, numerics)
        out = kernels.dsv4_attention(
            q, paged.pages("window"), paged.layer("window"), paged.table("window"), self.sinks[...],
            token_seq_ids=batch.seq_ids, token_positions=positions, window=self.window, sm_scale=dim ** -0.5,
            batch_invariant=invariant, impl=impl, **entries)

        def project(out, positions):
            out = self.rope(out, positions, inverse=True)
            return self.o_a_proj(out.reshape(out.shape[0], self.groups, -1))

        return self.o_b_proj(_per_token(project, numerics, out, positions), numerics)

    def _select(self, x: Array, q_residual: Array, paged: LayerKV, batch: RaggedBatch,
                numerics: str) -> Int[Array, "tokens topk"]:
        """The indexer: store this step's indexer inputs and finished keys, then each token's top-k."""
        indexer = self.indexer
        indexer.update(x, paged, batch, numerics, "index_state", "index_entries", self.compress_rope, self.impl)
        index_q = indexer.q_b_proj(q_residual, numerics).reshape(x.shape[0], indexer.num_heads, indexer.head_dim)
        index_q = _per_token(self.compress_rope, numerics, index_q, batch.positions)
        weights = indexer.weights_proj(x, numerics).astype(jnp.float32) * indexer.num_heads ** -0.5
        selected = kernels.dsv4_indexer_topk(
            index_q, weights, paged.pages("index_entries"), paged.layer("index_entries"), paged.table("index_entries"),
            token_seq_ids=batch.seq_ids, token_positions=batch.positions, ratio=indexer.rate, topk=indexer.top_k,
            sm_scale=indexer.head_dim ** -0.5, batch_invariant=numerics == "batch_invariant", impl=self.impl)
        return selected


class SlidingWindowMQA(DeepseekV4Attention):
    """The sliding-window-only layer (transformers' "sliding_attention"; the MTP layer too): main RoPE."""

    layer_type = "swa_mqa"


class CompressedSparseAttention(DeepseekV4Attention):
    """CSA: the window plus the indexer's top-k of the 2-series compressed entries (compress RoPE)."""

    layer_type = "csa"


class HeavilyCompressedAttention(DeepseekV4Attention):
    """HCA: the window plus every finished 1-series compressed entry (compress RoPE)."""

    layer_type = "hca"
