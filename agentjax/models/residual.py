"""Residual topologies: how each layer's token mixer and MLP read the residual and add to it.

The decoder carries a residual *stream* (a pytree) through its layer scan instead of a bare hidden
state. Each layer holds a per-layer topology module (`layer_residual(cfg)`) and the decoder a stream
module (`residual_stream(cfg)`) that starts the stream from the embeddings and turns it back into one
hidden state before the final norm. The step path calls the same four methods for every model; a
model picks its topology by config, never by a branch in the decoder.

- `PlainResidual`: the pre-norm residual, `x + mixer(norm(x))` then `x + mlp(norm(x))`; the stream is x.
- `BlockAttentionResidual`: Kimi-K3's block attention residuals (AttnRes). The layers form blocks of
  `attn_res_block_size`; the stream holds the finished block sums `b_0 = embeddings, b_1, ...` and
  the running sum of the current block. The mixer and the MLP of each layer read a softmax mix of
  those sources (`AttentionResidualMix`, one learned pseudo-query each), not the running sum itself,
  and add their outputs to the running sum. A block closes when layer `i % block_size == 0` starts.
- `HyperConnectionResidual`: DeepSeek-V4's mHC (transformers' DeepseekV4HyperConnection). The stream
  is N parallel copies of the hidden state; around each block a `StreamMix` reads all N and gives
  `pre` (the block input is `sum_n pre_n h_n`), `post` and `comb` (the new streams are
  `post_k * out + sum_j comb_jk h_j`, comb made doubly stochastic by Sinkhorn-Knopp); the decoder's
  `HyperHead` collapses the streams into one hidden state before the final norm.
Pure jnp on the stream: no KV access, no model imports.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax.config import ModelConfig
from agentjax.numerics import map_row_blocks


class PlainResidual(nnx.Module):
    """A layer's pre-norm residual: the stream is the hidden state itself."""

    def mixer_input(self, stream: Array, layer: Int[Array, ""], numerics: str) -> tuple[Array, Array]:
        return stream, stream

    def mlp_input(self, stream: Array, mixer_out: Array, numerics: str) -> tuple[Array, Array]:
        x = stream + mixer_out
        return x, x

    def add_mlp_output(self, stream: Array, mlp_out: Array, numerics: str = "fast") -> Array:
        return stream + mlp_out


class PlainStream(nnx.Module):
    """The decoder's side of the plain residual: nothing to start or finish."""

    def start(self, x: Array) -> Array:
        return x

    def finish(self, stream: Array, numerics: str) -> Array:
        return stream


class AttentionResidualMix(nnx.Module):
    """`sum_j p_j v_j` over sources `v_j` with `p = softmax_j(query . (norm * rmsnorm(v_j)))`, in float32.

    The sources of a token are its finished block sums (the first `num_blocks` of `blocks`) and the
    running sum `partial`; unfinished block slots get probability exactly 0. Parameters: `norm` [d]
    (the RMSNorm weight) and `query` [d] (the pseudo-query; zero at init, so the mix starts uniform).
    """

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.norm = nnx.Param(jnp.ones((dim,), dtype))
        self.query = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, partial: Float[Array, "tokens d"], blocks: Float[Array, "tokens slots d"],
                 num_blocks: Int[Array, ""], numerics: str) -> Float[Array, "tokens d"]:
        score_weight = self.norm[...].astype(jnp.float32) * self.query[...].astype(jnp.float32)
        valid = jnp.arange(blocks.shape[1] + 1) < num_blocks
        valid = valid.at[-1].set(True)  # the running sum is always a source

        def mix(partial_rows: Array, block_rows: Array) -> Array:
            sources = jnp.concatenate([block_rows, partial_rows[:, None]], axis=1).astype(jnp.float32)
            normed = sources * jax.lax.rsqrt(jnp.mean(sources * sources, axis=-1, keepdims=True) + self.eps)
            scores = jnp.where(valid, jnp.sum(normed * score_weight, axis=-1), -jnp.inf)
            weights = jax.nn.softmax(scores, axis=-1)
            return jnp.einsum("rs,rsd->rd", weights, sources).astype(partial_rows.dtype)

        return map_row_blocks(mix, partial, blocks) if numerics == "batch_invariant" else mix(partial, blocks)


def max_attention_blocks(cfg: ModelConfig) -> int:
    """Block sums a model finishes at most (the embeddings count as the first)."""
    return math.ceil(cfg.num_layers / cfg.attn_res_block_size)


class BlockAttentionResidual(nnx.Module):
    """A layer's AttnRes: its mixer and MLP each read their own mix of the block sums.

    Stream: `(partial [T, d], blocks [T, max_blocks + 1, d], num_blocks int32)`; the slot after the
    finished ones is scratch (written every layer, read only once a block closes into it).
    """

    def __init__(self, cfg: ModelConfig):
        self.attn_res = AttentionResidualMix(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.mlp_res = AttentionResidualMix(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.block_size = cfg.attn_res_block_size

    def mixer_input(self, stream: tuple, layer: Int[Array, ""], numerics: str) -> tuple[tuple, Array]:
        partial, blocks, num_blocks = stream
        mixed = self.attn_res(partial, blocks, num_blocks, numerics)
        # A layer that starts a block closes the current one: its running sum becomes a source.
        starts_block = (layer % self.block_size) == 0
        blocks = jax.lax.dynamic_update_slice_in_dim(blocks, partial[:, None], num_blocks, axis=1)
        partial = jnp.where(starts_block, jnp.zeros_like(partial), partial)
        return (partial, blocks, num_blocks + starts_block.astype(jnp.int32)), mixed

    def mlp_input(self, stream: tuple, mixer_out: Array, numerics: str) -> tuple[tuple, Array]:
        partial, blocks, num_blocks = stream
        partial = partial + mixer_out
        return (partial, blocks, num_blocks), self.mlp_res(partial, blocks, num_blocks, numerics)

    def add_mlp_output(self, stream: tuple, mlp_out: Array, numerics: str = "fast") -> tuple:
        partial, blocks, num_blocks = stream
        return partial + mlp_out, blocks, num_blocks


class BlockAttentionStream(nnx.Module):
    """The decoder's side of AttnRes: the embeddings start the stream; the output is one last mix."""

    def __init__(self, cfg: ModelConfig):
        self.output_res = AttentionResidualMix(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.num_slots = max_attention_blocks(cfg) + 1

    def start(self, x: Array) -> tuple:
        blocks = jnp.zeros((x.shape[0], self.num_slots, x.shape[1]), x.dtype)
        return x, blocks, jnp.zeros((), jnp.int32)

    def finish(self, stream: tuple, numerics: str) -> Array:
        partial, blocks, num_blocks = stream
        return self.output_res(partial, blocks, num_blocks, numerics)


def _per_token(fn, numerics: str, *arrays: Array):
    """`fn` on rows; in "batch_invariant" numerics over fixed row blocks (its matmul and reductions too),
    fenced by optimization barriers: when a batch is one block, XLA drops the block loop and would
    otherwise fuse its multiply-adds with the neighbours' into differently rounded FMAs."""
    if numerics != "batch_invariant":
        return fn(*arrays)
    return jax.lax.optimization_barrier(map_row_blocks(fn, *jax.lax.optimization_barrier(arrays)))


def _normed_flat(streams: Float[Array, "rows n d"], eps: float) -> Float[Array, "rows nd"]:
    """The streams of each token side by side, RMS-normalised without a weight, in float32."""
    flat = streams.reshape(streams.shape[0], -1).astype(jnp.float32)
    return flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)


def _collapse(streams: Float[Array, "rows n d"], pre: Float[Array, "rows n"]) -> Float[Array, "rows d"]:
    """`sum_n pre_n h_n` as a fixed sum of elementwise products (no reduction XLA may reorder)."""
    total = pre[:, 0, None] * streams[:, 0].astype(jnp.float32)
    for n in range(1, streams.shape[1]):
        total = total + pre[:, n, None] * streams[:, n].astype(jnp.float32)
    return total.astype(streams.dtype)


def _expand(streams: Array, out: Float[Array, "rows d"], post: Array, comb: Array, numerics: str) -> Array:
    """New streams `post_k * out + sum_j comb_jk h_j` (comb consumed transposed, as transformers does);
    over fixed row blocks in "batch_invariant" numerics (XLA's CPU code for the multiply-adds, and so
    their rounding, depends on the row count)."""
    def expand(h: Array, o: Array, p: Array, c: Array) -> Array:
        total = p[:, :, None] * o[:, None, :].astype(jnp.float32)
        for j in range(h.shape[1]):
            total = total + c[:, j, :, None] * h[:, j, None, :].astype(jnp.float32)
        return total.astype(h.dtype)

    return _per_token(expand, numerics, streams, out, post, comb)


class StreamMix(nnx.Module):
    """One mHC mapping: from a token's N streams, `pre`, `post` [N] and the Sinkhorn-normalised `comb` [N, N].

    `mix = rmsnorm(streams as one N*D row) @ fn`, split into [N | N | N*N];
    `pre = sigmoid(mix_pre * scale_0 + base_pre) + eps`, `post = 2 sigmoid(mix_post * scale_1 + base_post)`,
    `comb = softmax_rows(mix_comb * scale_2 + base_comb) + eps`, then columns and rows are divided by
    their sums (+ eps) in turn, `sinkhorn_iterations` column steps in all. Parameters: `fn` [N*D, (2+N)N]
    (HF `hc_{attn,ffn}_fn` [(2+N)N, N*D] transposed), `base` [(2+N)N], `scale` [3]; all used in float32.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        hc = cfg.hyper_connections
        n, width = hc.num_streams, hc.num_streams * cfg.hidden_size
        outputs = (2 + n) * n
        self.fn = nnx.Param((jax.random.normal(rngs.params(), (width, outputs), jnp.float32)
                             / math.sqrt(width)).astype(cfg.dtype))
        self.base = nnx.Param(jnp.zeros((outputs,), cfg.dtype))
        self.scale = nnx.Param(jnp.ones((3,), cfg.dtype))
        self.num_streams, self.iterations, self.eps = n, hc.sinkhorn_iterations, hc.eps
        self.norm_eps = cfg.rms_norm_eps

    def __call__(self, streams: Float[Array, "tokens n d"], numerics: str
                 ) -> tuple[Float[Array, "tokens d"], Float[Array, "tokens n"], Float[Array, "tokens n n"]]:
        """The block input (streams collapsed by `pre`), and `post` and `comb` for `_expand`."""
        n, eps = self.num_streams, self.eps
        fn, base, scale = (p[...].astype(jnp.float32) for p in (self.fn, self.base, self.scale))

        def mix(rows: Array) -> tuple[Array, Array, Array]:
            weights = _normed_flat(rows, self.norm_eps) @ fn
            pre = jax.nn.sigmoid(weights[:, :n] * scale[0] + base[:n]) + eps
            post = 2.0 * jax.nn.sigmoid(weights[:, n:2 * n] * scale[1] + base[n:2 * n])
            logits = (weights[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n)
            comb = jax.nn.softmax(logits, axis=-1) + eps
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
            for _ in range(self.iterations - 1):
                # The barrier keeps each iteration's `comb` a value of its own: without it XLA fuses the
                # chain into every later sum, recomputing it (15,000 instructions at 20 iterations, and
                # seconds of compile time for each step shape). XLA then rewrites the divisions a little
                # differently: tiny-dsv4's logits moved by about 4e-6 when it was added.
                comb = jax.lax.optimization_barrier(comb)
                comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
                comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
            return _collapse(rows, pre), post, comb

        return _per_token(mix, numerics, streams)


class HyperConnectionResidual(nnx.Module):
    """A layer's mHC: `attn_hc` around the token mixer and `ffn_hc` around the MLP.

    Stream: `(streams [T, N, D], post [T, N], comb [T, N, N])`; `post` and `comb` carry the current
    block's expansion weights from `*_input` to the next call (their values between layers are unused).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_hc = StreamMix(cfg, rngs=rngs)
        self.ffn_hc = StreamMix(cfg, rngs=rngs)

    def mixer_input(self, stream: tuple, layer: Int[Array, ""], numerics: str) -> tuple[tuple, Array]:
        streams = stream[0]
        collapsed, post, comb = self.attn_hc(streams, numerics)
        return (streams, post, comb), collapsed

    def mlp_input(self, stream: tuple, mixer_out: Array, numerics: str) -> tuple[tuple, Array]:
        streams, post, comb = stream
        streams = _expand(streams, mixer_out, post, comb, numerics)
        collapsed, post, comb = self.ffn_hc(streams, numerics)
        return (streams, post, comb), collapsed

    def add_mlp_output(self, stream: tuple, mlp_out: Array, numerics: str = "fast") -> tuple:
        streams, post, comb = stream
        return _expand(streams, mlp_out, post, comb, numerics), post, comb


class HyperHead(nnx.Module):
    """The decoder's side of mHC: the embeddings start every stream; `finish` collapses the streams with
    `pre = sigmoid(rmsnorm(streams) @ fn * scale + base) + eps` (HF `hc_head`: fn [N, N*D] transposed
    to [N*D, N], base [N], scale [1])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        hc = cfg.hyper_connections
        n, width = hc.num_streams, hc.num_streams * cfg.hidden_size
        self.fn = nnx.Param((jax.random.normal(rngs.params(), (width, n), jnp.float32)
                             / math.sqrt(width)).astype(cfg.dtype))
        self.base = nnx.Param(jnp.zeros((n,), cfg.dtype))
        self.scale = nnx.Param(jnp.ones((1,), cfg.dtype))
        self.num_streams, self.eps, self.norm_eps = n, hc.eps, cfg.rms_norm_eps

    def start(self, x: Array) -> tuple:
        tokens, n = x.shape[0], self.num_streams
        streams = jnp.broadcast_to(x[:, None, :], (tokens, n, x.shape[1]))
        return streams, jnp.zeros((tokens, n), jnp.float32), jnp.zeros((tokens, n, n), jnp.float32)

    def finish(self, stream: tuple, numerics: str) -> Array:
        fn, base, scale = (p[...].astype(jnp.float32) for p in (self.fn, self.base, self.scale))

        def head(rows: Array) -> Array:
            pre = jax.nn.sigmoid((_normed_flat(rows, self.norm_eps) @ fn) * scale[0] + base) + self.eps
            return _collapse(rows, pre)

        return _per_token(head, numerics, stream[0])


def layer_residual(cfg: ModelConfig, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """A layer's residual topology, by config: mHC, AttnRes or the plain pre-norm residual."""
    if cfg.hyper_connections is not None:
        return HyperConnectionResidual(cfg, rngs=rngs or nnx.Rngs(0))
    return PlainResidual() if cfg.attn_res_block_size is None else BlockAttentionResidual(cfg)


def residual_stream(cfg: ModelConfig, *, rngs: nnx.Rngs | None = None) -> nnx.Module:
    """The decoder's side of the residual topology (how the stream starts and becomes one hidden state)."""
    if cfg.hyper_connections is not None:
        return HyperHead(cfg, rngs=rngs or nnx.Rngs(0))
    return PlainStream() if cfg.attn_res_block_size is None else BlockAttentionStream(cfg)
