"""Kimi delta attention (KDA), the linear-attention token mixer of Kimi-Linear and Kimi-K3.

Projects the ragged batch's tokens to q, k, v, the per-channel forget gate and the write strength,
hands the short convolution and the gated delta rule (state read from and written to each row's
state page) to `agentjax.kernels.kimi_delta_attention`, then applies the gated output norm and the
output projection. It keeps no state of its own: all of it lives in the layer's state-group pages.

Parameters (H heads, D head dim, P = H*D, K conv width, checkpoint names under `layers.{i}.attn.`;
Kimi-Linear's saved tensors are `model.layers.{i}.self_attn.<same name>.weight`, Linear kernels are
stored [in, out], i.e. transposed, everything else as saved):
  q_proj, k_proj, v_proj .kernel [hidden, P]      q_conv1d, k_conv1d, v_conv1d .weight [P, 1, K]
  f_a_proj.kernel [hidden, D], f_b_proj.kernel [D, P]  (transformers' forget_gate.*; saved without it)
  A_log [1, 1, H, 1] (Kimi-K3 saves [H]: reshape), dt_bias [P], b_proj.kernel [hidden, H]
  g_a_proj.kernel [hidden, D], g_b_proj.kernel [D, P] (Kimi-K3's full-rank gate: g_proj.kernel [hidden, P]),
  o_norm.weight [D], o_proj.kernel [P, hidden]
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from agentjax import kernels
from agentjax.config import ModelConfig
from agentjax.errors import InvalidRequestError
from agentjax.kv_buffers import LayerKV
from agentjax.models.layers import Linear, RMSNorm
from agentjax.models.mixer import PagedMixer

if TYPE_CHECKING:
    from agentjax.ragged_batch import RaggedBatch

# softplus(z) = z above this (transformers' overflow guard).
SOFTPLUS_THRESHOLD = 20.0


class ShortConv(nnx.Module):
    """One depthwise causal conv weight, `[channels, 1, K]` as the checkpoint stores it (no bias)."""

    def __init__(self, channels: int, kernel: int, *, dtype: str, rngs: nnx.Rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (channels, 1, kernel), jnp.float32)
                                 / math.sqrt(kernel)).astype(dtype))


def _forget_gate_init(rngs: nnx.Rngs, num_heads: int, width: int, dtype: str) -> tuple[Array, Array]:
    """FLA's initialisation: A = U(1, 16); dt = exp(U(log 1e-3, log 1e-1)), stored as softplus^-1(dt)."""
    a = jax.random.uniform(rngs.params(), (1, 1, num_heads, 1), jnp.float32, 1.0, 16.0)
    dt = jnp.exp(jax.random.uniform(rngs.params(), (width,), jnp.float32, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return jnp.log(a).astype(dtype), (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KimiDeltaAttention(PagedMixer):
    """One KDA layer over the paged state; `kv_groups["state"]` is its state kind."""

    def __init__(self, cfg: ModelConfig, layer: int, kv_groups: dict[str, int], *, rngs: nnx.Rngs):
        if cfg.kda is None:
            raise InvalidRequestError(f"layer {layer} is a KDA layer but the model has no kda config")
        heads, dim, kernel = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_kernel_size
        if kernel < 1:
            raise InvalidRequestError(f"kda.conv_kernel_size must be >= 1, got {kernel}")
        hidden, width, dtype = cfg.hidden_size, heads * dim, cfg.dtype
        self.q_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        self.q_conv1d = ShortConv(width, kernel, dtype=dtype, rngs=rngs)
        self.k_conv1d = ShortConv(width, kernel, dtype=dtype, rngs=rngs)
        self.v_conv1d = ShortConv(width, kernel, dtype=dtype, rngs=rngs)
        self.f_a_proj = Linear(hidden, dim, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(dim, width, dtype=dtype, rngs=rngs)
        a_log, dt_bias = _forget_gate_init(rngs, heads, width, dtype)
        self.A_log = nnx.Param(a_log)
        self.dt_bias = nnx.Param(dt_bias)
        self.b_proj = Linear(hidden, heads, dtype=dtype, rngs=rngs)
        if cfg.kda.full_rank_gate:  # Kimi-K3
            self.g_proj = Linear(hidden, width, dtype=dtype, rngs=rngs)
        else:
            self.g_a_proj = Linear(hidden, dim, dtype=dtype, rngs=rngs)
            self.g_b_proj = Linear(dim, width, dtype=dtype, rngs=rngs)
        self.full_rank_gate, self.gate_lower_bound = cfg.kda.full_rank_gate, cfg.kda.gate_lower_bound
        self.o_norm = RMSNorm(dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(width, hidden, dtype=dtype, rngs=rngs)
        self.num_heads, self.head_dim, self.conv_kernel_size = heads, dim, kernel
        self.impl = cfg.attention_impl
        self.kv_kinds = dict(kv_groups)

    def gates(self, x: Float[Array, "tokens hidden"], numerics: str) -> tuple[Array, Array]:
        """`(g [T, H, D], beta [T, H])` in float32: the per-channel log-decay
        `-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)` (Kimi-K3 with a gate lower bound b:
        `b * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))`) and the write strength `sigmoid(b_proj(x))`."""
        tokens = x.shape[0]
        z = self.f_b_proj(self.f_a_proj(x, numerics), numerics).astype(jnp.float32)
        z = (z + self.dt_bias[...].astype(jnp.float32)).reshape(tokens, self.num_heads, self.head_dim)
        decay_rate = jnp.exp(self.A_log[...].astype(jnp.float32).reshape(self.num_heads))[None, :, None]
        beta = jax.nn.sigmoid(self.b_proj(x, numerics).astype(jnp.float32))
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * jax.nn.sigmoid(decay_rate * z), beta
        softplus = jnp.where(z > SOFTPLUS_THRESHOLD, z, jnp.log(1.0 + jnp.exp(z)))
        return -decay_rate * softplus, beta

    def mix(self, x: Float[Array, "tokens hidden"], paged: LayerKV, numerics: str) -> Float[Array, "tokens hidden"]:
        tokens, width, batch = x.shape[0], self.num_heads * self.head_dim, paged.batch
        mixed = jnp.concatenate([self.q_proj(x, numerics), self.k_proj(x, numerics), self.v_proj(x, numerics)], -1)
        conv_weight = jnp.concatenate(
            [conv.weight[...].reshape(width, self.conv_kernel_size) for conv in (self.q_conv1d, self.k_conv1d,
                                                                                  self.v_conv1d)], 0)
        g, beta = self.gates(x, numerics)
        state_pages, table = paged.pages("state"), paged.table("state")
        draft_states = _draft_state_pages(batch, table, state_pages.shape[1])
        out, pages = kernels.kimi_delta_attention(
            mixed,
            g,
            beta,
            conv_weight,
            state_pages,
            batch.cu_q_lens,
            batch.kv_lens,
            table[:, 0],
            slot=paged.layer("state"),
            token_seq_ids=batch.seq_ids,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            batch_invariant=numerics == "batch_invariant",
            impl=self.impl,
            draft_states=draft_states,
            state_saves=_interval_state_pages(batch, table, state_pages.shape[1]),
        )
        gate = self.g_proj(x, numerics) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x, numerics), numerics)
        gate = gate.reshape(tokens, self.num_heads, self.head_dim)
        # transformers' gated RMSNorm: all in float32 (`out` is float32, so the norm stays float32).
        out = self.o_norm(out, numerics) * jax.nn.sigmoid(gate.astype(jnp.float32))
        paged.store("state", pages)
        return self.o_proj(out.reshape(tokens, width).astype(x.dtype), numerics)


def _draft_state_pages(batch: RaggedBatch, table: Array, num_pages: int) -> tuple[Array, Array, Array]:
    """`(token index, row, page)` per sampled token: a row that carries draft tokens (speculative decoding)
    keeps the state after its i-th sampled token in page i of its state `table` (page 0, the running page,
    after its real token); other samples get page `num_pages` (not saved)."""
    offsets = batch.sample_offsets
    rows = jnp.where(offsets >= 0, batch.seq_ids[batch.logits_indices], 0)
    drafting = jnp.zeros(batch.num_seqs, bool).at[rows].max(offsets >= 1)
    page = jnp.take_along_axis(table[rows], jnp.clip(offsets, 0, table.shape[1] - 1)[:, None], axis=1)[:, 0]
    saved = (offsets >= 0) & drafting[rows] & (offsets < table.shape[1])
    return batch.logits_indices, rows, jnp.where(saved, page, num_pages)


def _interval_state_pages(batch: RaggedBatch, table: Array, num_pages: int) -> tuple[Array, Array] | None:
    """`(token index, page)` per recurrent-state checkpoint inside this step's prefill chunks: the page in
    column `state_save_cols` of the token's row's state `table`; `num_pages` (not saved) for padding."""
    if batch.state_save_tokens is None:
        return None
    tokens, columns = batch.state_save_tokens, batch.state_save_cols
    rows = batch.seq_ids[jnp.clip(tokens, 0, batch.num_tokens - 1)]
    page = table[rows, jnp.clip(columns, 0, table.shape[1] - 1)]
    saved = (columns > 0) & (columns < table.shape[1]) & (tokens < batch.num_tokens)
    return tokens, jnp.where(saved, page, num_pages)
