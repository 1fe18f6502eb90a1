"""The online softmax every attention reference and kernel here streams its keys with: the running max,
the rescale and the accumulate of one block, a sink logit joining the denominator, and the result.

One home for that arithmetic, so a reference and its kernel fold a block in the same order. Pure jnp
with explicit broadcasts (no `[..., None]`), so it runs in jnp references and inside Triton and Mosaic
GPU kernel bodies alike; it never loads or stores.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# Finite stand-in for -inf in the running max: a fully masked block then leaves the accumulators
# exactly unchanged (exp(-inf - finite) == 0, exp(0) == 1) instead of making NaN.
NEG_LARGE = -1e30

Carry = tuple[Array, Array, Array]  # (running max [rows], denominator [rows], accumulator [rows, dim])


def _along(x: Array, shape: tuple[int, ...]) -> Array:
    """`x` (the leading axes of `shape`) broadcast over the trailing ones."""
    return jax.lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)))


def online_softmax_init(rows: tuple[int, ...], dim: int) -> Carry:
    """The empty carry for query rows of shape `rows` and values of width `dim` (float32)."""
    return (jnp.full(rows, NEG_LARGE, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, dim), jnp.float32))


def online_softmax_step(carry: Carry, scores: Float[Array, "*rows keys"], weigh_values) -> Carry:
    """Fold one block of `scores` (masked keys: -inf) into the carry: rescale by exp(m - m_new), add
    the block's weights `p` to the denominator and `weigh_values(p)` (p times the block's values,
    `[*rows, dim]`) to the accumulator."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, scores.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - _along(m_new, scores.shape))
    return m_new, denom * alpha + p.sum(axis=-1), acc * _along(alpha, acc.shape) + weigh_values(p)


def fold_sink(carry: Carry, sink: Float[Array, "*rows"]) -> Carry:
    """A sink logit per row joins the denominator and carries no value."""
    m, denom, acc = carry
    m_final = jnp.maximum(m, sink)
    alpha = jnp.exp(m - m_final)
    return m_final, denom * alpha + jnp.exp(sink - m_final), acc * _along(alpha, acc.shape)


def online_softmax_result(carry: Carry) -> tuple[Float[Array, "*rows dim"], Float[Array, "*rows"]]:
    """`(out, lse)` in float32: a row that saw no key (denominator 0) gets out 0 and LSE -inf."""
    m, denom, acc = carry
    safe_denom = jnp.where(denom == 0, 1.0, denom)
    return acc / _along(safe_denom, acc.shape), jnp.where(denom == 0, -jnp.inf, m + jnp.log(safe_denom))
