"""Building blocks of the decoder: RMSNorm, the gated MLP, RoPE; `dense` comes from agentjax.numerics.

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
from agentjax.models.activations import GatedActivation
from agentjax.numerics import dense, map_row_blocks

__all__ = ["GatedMLP", "Linear", "RMSNorm", "apply_rope", "dense", "map_row_blocks", "rope_inverse_frequencies"]


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
    """`down(act(gate(x), up(x)))` with a gated activation of agentjax.models.activations (SiLU, tanh-GELU,
    MiniMax's clamped "swigluoai", Kimi-K3's "situ")."""

    def __init__(self, hidden: int, intermediate: int, activation: str, *, dtype: str, rngs: nnx.Rngs,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0):
        self.gate_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)
        self.activation = GatedActivation(activation, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                          situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)

    def __call__(self, x: Array, numerics: str = "fast", *, token_ids: Array | None = None,
                 real_tokens: Array | None = None) -> Array:
        """`token_ids` and `real_tokens` belong to the feed-forward call (an MoE reads them); unused here."""
        return self.down_proj(self.activation(self.gate_proj(x, numerics), self.up_proj(x, numerics)), numerics)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jnp.ndarray:
    """Per-pair inverse frequencies, with linear, llama3 or YaRN scaling applied."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
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


def _yarn_inverse_frequencies(inv_freq: Array, dim: int, theta: float, scaling: RopeScaling) -> Array:
    """YaRN as transformers computes it: frequencies below the beta_slow rotation count are divided by
    the factor, those above beta_fast kept, a linear ramp between (over `original_max_position_embeddings`)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # the share of each frequency left unscaled
    return (inv_freq / scaling.factor) * (1.0 - keep) + inv_freq * keep


def yarn_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor YaRN multiplies cos and sin by: `attention_factor`, else `0.1 ln(factor) + 1` (1 without YaRN)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def apply_rope(
    x: Float[Array, "tokens heads dim"], positions: Int[Array, " tokens"], inv_freq: Array, scale: float = 1.0
) -> Float[Array, "tokens heads dim"]:
    """Rotate-half RoPE (the HF layout: the two halves of the rotated channels form the pairs) on
    the first `2 * len(inv_freq)` channels of each head; the rest pass through (partial RoPE).
    `scale` multiplies cos and sin (YaRN's attention factor, `yarn_attention_factor`)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x.astype(jnp.float32)
    half = inv_freq.shape[0]
    x1, x2, rest = x32[..., :half], x32[..., half:2 * half], x32[..., 2 * half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)
