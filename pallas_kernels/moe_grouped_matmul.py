"""MoE grouped matmul (the `jax.lax.ragged_dot` shape): the jnp reference and a Triton-style Pallas kernel.

`lhs [M, K]` holds token-expert rows sorted by expert, `group_sizes [G]` how many rows each
expert owns (rows past their sum get zeros), `rhs [G, K, N]` the expert weights: plain, FP8
(e4m3 with block scales, DeepSeek-style) or MXFP4 (e2m1 nibbles with one power-of-two scale
per 32 contraction elements, OCP microscaling). The reference dequantises, then runs ragged_dot;
the kernel dequantises each weight tile in registers. The kernel targets Pallas' Triton backend
on a GPU and runs in interpret mode on a CPU; the CPU runner never uses it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from agentjax.errors import KernelShapeError
from pallas_kernels.ragged_work import work_items
from pallas_kernels.triton_call import check_tiles, spare_rows, store_index, triton_call

MXFP4_BLOCK = 32  # contraction elements sharing one E8M0 scale
# E2M1 magnitudes of codes 0..7 (bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Fp8Experts:
    """FP8 expert weights: `values [G, K, N]` float8_e4m3fn times `scales [G, K/bk, N/bn]` float32,
    one scale per `(bk, bn)` block (DeepSeek-V3 / Kimi `weight_scale_inv`, transposed to [in, out])."""

    values: Array
    scales: Array

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.values.shape)

    @property
    def scale_block(self) -> tuple[int, int]:
        _, k, n = self.values.shape
        return k // self.scales.shape[1], n // self.scales.shape[2]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Mxfp4Experts:
    """MXFP4 expert weights, split-half packed: `packed [G, K/2, N]` uint8 whose byte row r holds
    contraction row r in its low nibble and row r + K/2 in its high nibble, and `scales [G, K/32, N]`
    uint8 E8M0 exponents (scale = 2**(s - 127)) for each 32 consecutive contraction rows. K is a
    multiple of 64. `mxfp4_from_blocks` converts the OCP/gpt-oss layout (adjacent pairs per byte)."""

    packed: Array
    scales: Array

    @property
    def shape(self) -> tuple[int, int, int]:
        g, half_k, n = self.packed.shape
        return g, 2 * half_k, n


def _e2m1_to_float(code: Array) -> Array:
    """Float32 value of 4-bit E2M1 codes held in int32 (no table lookup: the kernel uses it too)."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).astype(jnp.float32)
    power = jnp.where(exponent == 1, 1.0, jnp.where(exponent == 2, 2.0, 4.0))
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    return jnp.where((code >> 3) & 1 == 1, -magnitude, magnitude)


def _e8m0_to_float(exponent: Array) -> Array:
    return jnp.exp2(exponent.astype(jnp.float32) - 127.0)


def dequantize(rhs) -> Float[Array, "groups k n"]:
    """The float32 weights an `Fp8Experts` or `Mxfp4Experts` stands for (plain arrays pass through)."""
    if isinstance(rhs, Fp8Experts):
        block_k, block_n = rhs.scale_block
        scales = jnp.repeat(jnp.repeat(rhs.scales, block_k, axis=1), block_n, axis=2)
        return rhs.values.astype(jnp.float32) * scales
    if isinstance(rhs, Mxfp4Experts):
        codes = rhs.packed.astype(jnp.int32)
        values = jnp.concatenate([_e2m1_to_float(codes & 15), _e2m1_to_float(codes >> 4)], axis=1)
        return values * jnp.repeat(_e8m0_to_float(rhs.scales), MXFP4_BLOCK, axis=1)
    return rhs


@functools.partial(jax.jit, static_argnames="block")
def quantize_fp8(weights: Float[Array, "groups k n"], block: tuple[int, int] = (128, 128)) -> Fp8Experts:
    """Block-scaled e4m3 weights (scale = block max / 448), as FP8 checkpoints store them."""
    groups, k, n = weights.shape
    bk, bn = min(block[0], k), min(block[1], n)
    tiles = weights.astype(jnp.float32).reshape(groups, k // bk, bk, n // bn, bn)
    scales = jnp.maximum(jnp.abs(tiles).max(axis=(2, 4)), 1e-12) / 448.0
    values = (tiles / scales[:, :, None, :, None]).reshape(groups, k, n).astype(jnp.float8_e4m3fn)
    return Fp8Experts(values=values, scales=scales)


@jax.jit
def quantize_mxfp4(weights: Float[Array, "groups k n"]) -> Mxfp4Experts:
    """OCP MX quantisation (shared exponent floor(log2(amax)) - 2; codes rounded to the nearest
    E2M1 value, ties down; magnitudes past 6 saturate)."""
    groups, k, n = weights.shape
    if k % (2 * MXFP4_BLOCK):
        raise KernelShapeError(f"MXFP4 weights need K a multiple of {2 * MXFP4_BLOCK}; got K={k}")
    blocks = weights.astype(jnp.float32).reshape(groups, k // MXFP4_BLOCK, MXFP4_BLOCK, n)
    amax = jnp.abs(blocks).max(axis=2)
    exponent = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.maximum(amax, 1e-30))) - 2, -127)
    exponent = jnp.clip(exponent, -127, 127)
    scaled = blocks / jnp.exp2(exponent)[:, :, None, :]
    magnitude = jnp.abs(scaled)
    codes = jnp.zeros(scaled.shape, jnp.int32)
    for low, high in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:]):  # count the midpoints below |x|
        codes += (magnitude > (low + high) / 2).astype(jnp.int32)
    codes = (codes | jnp.where(scaled < 0, 8, 0)).reshape(groups, k, n)
    packed = (codes[:, : k // 2] | (codes[:, k // 2:] << 4)).astype(jnp.uint8)
    return Mxfp4Experts(packed=packed, scales=(exponent + 127).astype(jnp.uint8))


def mxfp4_from_blocks(blocks: np.ndarray, scales: np.ndarray) -> Mxfp4Experts:
    """Host conversion from the OCP/gpt-oss layout: `blocks [G, N, K/32, 16]` uint8 (element 2i in
    the low nibble of byte i), `scales [G, N, K/32]` uint8, to the kernel's split-half layout."""
    groups, n, num_blocks, _ = blocks.shape
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(groups, n, num_blocks * MXFP4_BLOCK)
    codes = codes.transpose(0, 2, 1)  # [G, K, N]
    k = codes.shape[1]
    packed = (codes[:, : k // 2] | (codes[:, k // 2:] << 4)).astype(np.uint8)
    return Mxfp4Experts(packed=jnp.asarray(packed), scales=jnp.asarray(scales.transpose(0, 2, 1)))


def grouped_matmul_reference(
    lhs: Float[Array, "m k"], rhs, group_sizes: Int[Array, " groups"]
) -> Float[Array, "m n"]:
    """`ragged_dot(lhs, dequantize(rhs) in lhs's dtype, group_sizes)` with float32 accumulation."""
    weights = dequantize(rhs).astype(lhs.dtype)
    out = jax.lax.ragged_dot(lhs, weights, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def _grouped_matmul_kernel(
    item_group_ref, item_start_ref, item_count_ref, lhs_ref, *refs, num_groups, block_m, block_n, block_k,
    weight_format, scale_block, interpret,
):
    out_ref = refs[-1]
    weight_refs = refs[:-1]
    item, column_block = pl.program_id(0), pl.program_id(1)
    group, start, count = item_group_ref[item], item_start_ref[item], item_count_ref[item]
    m, k = lhs_ref.shape
    n = out_ref.shape[1]
    row = jnp.arange(block_m, dtype=jnp.int32)
    row_used = row < count
    lhs_rows = jnp.minimum(start + row, m - 1) if interpret else start + row
    column = column_block * block_n + jnp.arange(block_n, dtype=jnp.int32)
    column_used = column < n
    # The tail segment (rows past the groups' sum) runs no step and stores zeros.
    num_steps = jnp.where(group < num_groups, pl.cdiv(k, block_k), 0)
    weight_group = jnp.minimum(group, num_groups - 1)
    precise = dict(allow_tf32=False) if lhs_ref.dtype == jnp.float32 else {}

    def load_lhs(first, size):
        lane = first + jnp.arange(size, dtype=jnp.int32)
        mask = row_used[:, None] & (lane < k)[None, :]
        return plt.load(lhs_ref.at[lhs_rows[:, None], lane[None, :]], mask=mask, other=0)

    def weight_index(rows):
        return jnp.full((rows.shape[0], 1), weight_group, jnp.int32), rows[:, None], column[None, :]

    def step(kb, acc):
        first = kb * block_k
        if weight_format == "mxfp4":
            packed_ref, scales_ref = weight_refs
            half = block_k // 2
            rows = kb * half + jnp.arange(half, dtype=jnp.int32)
            mask = jnp.broadcast_to(column_used[None, :], (half, block_n))
            codes = plt.load(packed_ref.at[weight_index(rows)], mask=mask, other=0).astype(jnp.int32)
            for nibble, offset in ((codes & 15, 0), (codes >> 4, k // 2)):
                scale_rows = (rows + offset) // MXFP4_BLOCK
                scale = plt.load(scales_ref.at[weight_index(scale_rows)], mask=mask, other=127)
                weights = (_e2m1_to_float(nibble) * _e8m0_to_float(scale)).astype(lhs_ref.dtype)
                acc += plt.dot(load_lhs(kb * half + offset, half), weights, **precise)
            return acc
        rows = first + jnp.arange(block_k, dtype=jnp.int32)
        mask = (rows < k)[:, None] & column_used[None, :]
        zero = jnp.zeros((), weight_refs[0].dtype)
        weights = plt.load(weight_refs[0].at[weight_index(rows)], mask=mask, other=zero)
        if weight_format == "fp8":
            scale_index = (jnp.full((block_k, 1), weight_group, jnp.int32), (rows // scale_block[0])[:, None],
                           (column // scale_block[1])[None, :])
            scale = plt.load(weight_refs[1].at[scale_index], mask=mask, other=0)
            weights = weights.astype(jnp.float32) * scale
        return acc + plt.dot(load_lhs(first, block_k), weights.astype(lhs_ref.dtype), **precise)

    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    store_rows = store_index(start + row, row_used, out_ref.shape[0] - 1, interpret)
    plt.store(out_ref.at[store_rows[:, None], column[None, :]], acc.astype(out_ref.dtype),
              mask=row_used[:, None] & column_used[None, :])


def grouped_matmul(
    lhs: Float[Array, "m k"],
    rhs,
    group_sizes: Int[Array, " groups"],
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> Float[Array, "m n"]:
    """`grouped_matmul_reference` as one kernel: one program per (block of <= `block_m` rows of one
    group, `block_n` output columns), accumulating over `block_k` contraction steps in float32.
    Block sizes are powers of two >= 16 (`block_k` >= 32 for MXFP4). The output has lhs's dtype."""
    if isinstance(rhs, Fp8Experts):
        weight_format, weight_arrays, scale_block = "fp8", (rhs.values, rhs.scales), rhs.scale_block
    elif isinstance(rhs, Mxfp4Experts):
        weight_format, weight_arrays, scale_block = "mxfp4", (rhs.packed, rhs.scales), None
    else:
        weight_format, weight_arrays, scale_block = "plain", (rhs,), None
    m, k = lhs.shape
    num_groups, rhs_k, n = rhs.shape
    if rhs_k != k or group_sizes.shape != (num_groups,):
        raise KernelShapeError(f"grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                               f"{group_sizes.shape} do not fit [M, K] x [G, K, N] with [G] sizes")
    check_tiles("grouped_matmul", dict(block_m=block_m, block_n=block_n, block_k=block_k))
    if weight_format == "mxfp4" and (block_k < 32 or k % (2 * MXFP4_BLOCK)):
        raise KernelShapeError(f"grouped_matmul: MXFP4 needs block_k >= 32 and K a multiple of 64; got "
                               f"block_k={block_k}, K={k}")

    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    # Segments: the G groups, then the tail of rows no group owns (zeros, as ragged_dot gives).
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends, jnp.full((1,), m, jnp.int32)])
    item_group, item_start, item_count = work_items(bounds, m, block_m)
    kernel = functools.partial(
        _grouped_matmul_kernel, num_groups=num_groups, block_m=block_m, block_n=block_n, block_k=block_k,
        weight_format=weight_format, scale_block=scale_block, interpret=interpret,
    )
    spare = spare_rows(interpret)
    out = triton_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m + spare, n), lhs.dtype),
        grid=(item_group.shape[0], pl.cdiv(n, block_n)), name=f"grouped_matmul_{weight_format}",
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )(item_group, item_start, item_count, lhs, *weight_arrays)
    return out[:m] if spare else out
