"""Building blocks of the decoder: RMSNorm, the gated MLP, RoPE and the batch-invariant dense.

Each layer is a Flax NNX module whose parameters are plain arrays, so checkpoints can fill them
by name. `dense` is the one place a matmul happens. In "batch_invariant" numerics, matmuls and norms
run over fixed-size row blocks, so a row's result never depends on how many rows share the batch.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from agentjax.config import RopeScaling
from pallas_kernels.ragged_paged_attention import map_row_blocks


def dense(x: Float[Array, "rows k"], kernel: Float[Array, "k n"], numerics: str) -> Float[Array, "rows n"]:
    """`x @ kernel`; in "batch_invariant" numerics, computed in fixed blocks of rows."""
    if numerics != "batch_invariant":
        return x @ kernel
    return map_row_blocks(lambda block: block @ kernel, x)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: str, scale: float | None = None) -> Array:
    scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * scale).astype(dtype)


class Linear(nnx.Module):
    """A bias-free projection with its kernel stored as [in, out]."""

    def __init__(self, in_features: int, out_features: int, *, dtype: str, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (in_features, out_features), dtype))

    def __call__(self, x: Array, numerics: str = "fast") -> Array:
        return dense(x, self.kernel[...], numerics)


class RMSNorm(nnx.Module):
    """`x / rms(x) * weight`. Gemma's `1 + w` convention is folded into `weight` at load time."""

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array, numerics: str = "fast") -> Array:
        weight = self.weight[...].astype(jnp.float32)

        def normalize(rows: Array) -> Array:
            x32 = rows.astype(jnp.float32)
            normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return (normed * weight).astype(rows.dtype)

        # The mean is a reduction whose order XLA picks by row count; fixed blocks pin it.
        return map_row_blocks(normalize, x) if numerics == "batch_invariant" else normalize(x)


class GatedMLP(nnx.Module):
    """`down(act(gate(x)) * up(x))` with SiLU (llama) or tanh-GELU (gemma)."""

    def __init__(self, hidden: int, intermediate: int, activation: str, *, dtype: str, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.activation = activation

    def __call__(self, x: Array, numerics: str = "fast") -> Array:
        gate = self.gate_proj(x, numerics)
        if self.activation == "gelu_tanh":
            gate = jax.nn.gelu(gate, approximate=True)
        else:
            gate = jax.nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x, numerics), numerics)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jnp.ndarray:
    """Per-pair inverse frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by the factor, short ones kept, a smooth blend between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(middle, blended, scaled)


def apply_rope(
    x: Float[Array, "tokens heads dim"], positions: Int[Array, " tokens"], inv_freq: Array
) -> Float[Array, "tokens heads dim"]:
    """Rotate-half RoPE (the HF layout: the two halves of each head form the pairs)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
