"""Numerics helpers the models and kernels share: the one matmul entry point and fixed row blocks.

In "batch_invariant" numerics, matmuls and row reductions run over fixed-size blocks of rows
(`map_row_blocks`), because XLA's CPU backend picks a reduction strategy by row count: a row's
result would otherwise depend on how many rows share the batch (DESIGN.md section 4).
Pure jnp: no model, runner or kernel imports.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# Rows per block in batch-invariant mode: every block has the same shape whatever the batch,
# so XLA emits the same arithmetic for each row. Measured on XLA's CPU backend for 8..64.
INVARIANT_ROW_BLOCK = 8


def map_row_blocks(fn, *arrays: Array, block: int = INVARIANT_ROW_BLOCK) -> Array:
    """`fn(*arrays)` computed over fixed blocks of `block` leading rows (zero-padded), in order."""
    rows = arrays[0].shape[0]
    pad = (-rows) % block

    def blocked(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, block, *x.shape[1:])

    # The barriers keep XLA from fusing a block's arithmetic with its neighbours: with a single
    # block the map is inlined, and how it then fuses differs between one device and a layout.
    def one_block(xs):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(xs)))

    out = jax.lax.map(one_block, tuple(blocked(x) for x in arrays))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:rows], out)


def dense(x: Float[Array, "rows k"], kernel: Float[Array, "k n"], numerics: str) -> Float[Array, "rows n"]:
    """`x @ kernel`; in "batch_invariant" numerics, computed in fixed blocks of rows."""
    if numerics != "batch_invariant":
        return x @ kernel
    # A transposed kernel (a tied embedding's `embed.T`) would otherwise fold into the dot when the
    # map has a single block and stay a separate copy when it loops: two dot kernels, two roundings.
    kernel = jax.lax.optimization_barrier(kernel)
    return map_row_blocks(lambda block: block @ kernel, x)
