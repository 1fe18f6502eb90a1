"""Collectives by role, for code that runs inside the sharded step's `shard_map`.

Every function takes the `ParallelConfig` and a role of `sharding.mesh.ROLES` (never a raw axis
name) and is the identity when the role spans one rank, so a layout with size-1 axes lowers to no
collective at all. Also the exact column-sharded matmul of batch-invariant numerics, and the LSE
merge of decode context parallelism fused into the output's reduce-scatter. Device code only:
called while tracing inside `shard_map`, never on the host.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from agentjax.numerics import dense
from sharding.mesh import ParallelConfig, axes


def rank(parallel: ParallelConfig, role: str) -> Array:
    """This device's index among the ranks of `role` (0 when the role is not split)."""
    if parallel.role_size(role) == 1:
        return jnp.int32(0)
    return jax.lax.axis_index(axes(role))


def _across(parallel: ParallelConfig, role: str, x: Array, collective) -> Array:
    """`collective(x, axis names)` over the ranks of `role`; `x` itself when the role is not split."""
    if parallel.role_size(role) == 1:
        return x
    return collective(x, axes(role))


def all_gather(parallel: ParallelConfig, role: str, x: Array, axis: int) -> Array:
    """Concatenate every rank's `x` along `axis`, in rank order."""
    return _across(parallel, role, x, lambda x, names: jax.lax.all_gather(x, names, axis=axis % x.ndim, tiled=True))


def sum_over(parallel: ParallelConfig, role: str, x: Array) -> Array:
    """The sum of every rank's `x` (an all-reduce)."""
    return _across(parallel, role, x, jax.lax.psum)


def sum_scatter(parallel: ParallelConfig, role: str, x: Array, axis: int) -> Array:
    """Sum every rank's `x`, each rank keeping its slice of `axis` (a reduce-scatter)."""
    return _across(parallel, role, x, lambda x, names: jax.lax.psum_scatter(
        x, names, scatter_dimension=axis % x.ndim, tiled=True))


def all_to_all(parallel: ParallelConfig, role: str, x: Array) -> Array:
    """`x[j]` goes to rank j; the result's `[i]` came from rank i (leading axis = ranks)."""
    return _across(parallel, role, x, lambda x, names: jax.lax.all_to_all(
        x, names, split_axis=0, concat_axis=0, tiled=True))


def exact_columns(x: Float[Array, "rows k"], local_kernel: Float[Array, "k n_local"], columns: Array,
                  width: int) -> Float[Array, "rows n_local"]:
    """`x @ local_kernel` with the arithmetic of the single-device matmul: the shard is placed at its
    single-device `columns` of a zero `[k, width]` kernel and the whole width is multiplied in fixed
    row blocks. XLA's CPU matmul picks its blocking by the output width, so a narrower matmul would
    round differently; this costs the full width's FLOPs on every rank (batch-invariant numerics only)."""
    padded = jnp.zeros((local_kernel.shape[0], width), local_kernel.dtype).at[:, columns].set(local_kernel)
    return jnp.take(dense(x, padded, "batch_invariant"), columns, axis=-1)


def merge_partials_scatter_heads(parallel: ParallelConfig, out: Float[Array, "tokens heads dim"],
                                 lse: Float[Array, "tokens heads"]) -> Float[Array, "tokens local_heads dim"]:
    """DCP's merge of per-rank attention partials, fused into the reduce-scatter of the output: each
    rank scales its partial by `exp(lse_rank - lse_total)` (the LSEs are all-gathered, a few bytes per
    head) and one reduce-scatter over the heads both sums the scaled partials and hands each rank its
    own heads back. A rank whose shard held no visible key has LSE -inf and weighs nothing."""
    lses = jax.lax.all_gather(lse, axes("dcp"), axis=0)  # [dcp, tokens, heads]
    top = lses.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.exp(lses - top).sum(axis=0)
    safe = jnp.where(total == 0, 1.0, total)
    weight = jnp.exp(lse - top) / safe
    scaled = out.astype(jnp.float32) * weight[..., None]
    return sum_scatter(parallel, "dcp", scaled, axis=1).astype(out.dtype)
