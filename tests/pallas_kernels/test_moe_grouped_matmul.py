"""The MoE grouped matmul kernel (plain, FP8 and MXFP4 experts) against its ragged_dot reference."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentjax.errors import KernelShapeError
from pallas_kernels.moe_grouped_matmul import (
    E2M1_VALUES,
    Mxfp4Experts,
    dequantize,
    grouped_matmul,
    grouped_matmul_reference,
    mxfp4_from_blocks,
    quantize_fp8,
    quantize_mxfp4,
)

GROUP_SIZES = {
    "uneven": [10, 0, 50, 3, 30],
    "one_group": [0, 0, 93, 0, 0],
    "empty_groups_and_tail": [0, 17, 0, 0, 2],
    "no_rows": [0, 0, 0, 0, 0],
    "last_group_only": [0, 0, 0, 0, 93],
}


# Jitted once here: op by op, every jnp operation in them is an executable of its own.
_quantize_fp8 = jax.jit(quantize_fp8, static_argnums=1)
_quantize_mxfp4 = jax.jit(quantize_mxfp4)
_dequantize = jax.jit(dequantize)
_reference = jax.jit(grouped_matmul_reference)


def _weights(fmt, rng, groups, k, n):
    w = jnp.asarray(rng.standard_normal((groups, k, n)) * 0.1, jnp.float32)
    return {"plain": w, "fp8": _quantize_fp8(w, (32, 16)), "mxfp4": _quantize_mxfp4(w)}[fmt]


def _numpy_grouped(lhs, weights, sizes):
    out = np.zeros((lhs.shape[0], weights.shape[2]))
    start = 0
    for group, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ weights[group]
        start += size
    return out


_kernel = jax.jit(functools.partial(grouped_matmul, interpret=True), static_argnames=("block_m", "block_n", "block_k"))


@pytest.mark.parametrize("fmt", ["plain", "fp8", "mxfp4"])
@pytest.mark.parametrize("case", sorted(GROUP_SIZES))
def test_kernel_matches_reference_for_group_size_patterns(fmt, case):
    rng = np.random.default_rng(len(case))
    lhs = jnp.asarray(rng.standard_normal((93, 128)), jnp.float32)
    rhs = _weights(fmt, rng, 5, 128, 80)
    sizes = jnp.asarray(GROUP_SIZES[case], jnp.int32)
    want = _reference(lhs, rhs, sizes)
    got = _kernel(lhs, rhs, sizes, block_m=32, block_n=32, block_k=32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    owned = int(sum(GROUP_SIZES[case]))
    assert not np.asarray(got[owned:]).any(), "rows past the groups' sum are zero"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_is_a_per_group_matmul_of_the_dequantised_weights(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(60, np.ones(4) / 4)
    lhs = rng.standard_normal((64, 64)).astype(np.float32)
    rhs = _quantize_fp8(jnp.asarray(rng.standard_normal((4, 64, 48)), jnp.float32), (32, 16))
    want = _numpy_grouped(lhs.astype(np.float64), np.asarray(_dequantize(rhs), np.float64), sizes)
    got = _reference(jnp.asarray(lhs), rhs, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("blocks", [(16, 16, 16), (64, 128, 64), (32, 16, 128)])
def test_kernel_block_sizes_do_not_change_the_result(blocks):
    rng = np.random.default_rng(7)
    lhs = jnp.asarray(rng.standard_normal((70, 96)), jnp.float32)  # K and N not multiples of the blocks
    rhs = jnp.asarray(rng.standard_normal((3, 96, 40)), jnp.float32)
    sizes = jnp.asarray([31, 0, 36], jnp.int32)
    block_m, block_n, block_k = blocks
    got = _kernel(lhs, rhs, sizes, block_m=block_m, block_n=block_n, block_k=block_k)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(lhs, rhs, sizes)), atol=2e-5)


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
def test_kernel_in_bfloat16_stays_within_bfloat16_rounding(fmt):
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((48, 128)), jnp.bfloat16)
    rhs = _weights(fmt, rng, 4, 128, 64)
    rhs = rhs.astype(jnp.bfloat16) if fmt == "plain" else rhs
    sizes = jnp.asarray([5, 20, 0, 23], jnp.int32)
    got = _kernel(lhs, rhs, sizes, block_m=16, block_n=32, block_k=64)
    want = _reference(lhs, rhs, sizes)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=2e-2)


def test_mxfp4_dequantises_representable_weights_exactly():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 8, (2, 64, 8))
    signs = rng.choice([-1.0, 1.0], (2, 64, 8))
    exponents = rng.integers(-3, 3, (2, 2, 8))
    weights = signs * E2M1_VALUES[codes] * np.exp2(np.repeat(exponents, 32, axis=1))
    # Each 32-row block must hold a code >= 4 so its scale exponent is the drawn one.
    weights[:, ::32] = 6.0 * np.exp2(exponents)
    np.testing.assert_array_equal(np.asarray(_dequantize(_quantize_mxfp4(jnp.asarray(weights)))), weights)


def test_mxfp4_from_the_ocp_block_layout_equals_quantising_the_same_weights():
    rng = np.random.default_rng(5)
    quantised = _quantize_mxfp4(jnp.asarray(rng.standard_normal((3, 128, 16)), jnp.float32))
    codes = np.concatenate([np.asarray(quantised.packed) & 15, np.asarray(quantised.packed) >> 4], axis=1)  # [G,K,N]
    per_row = codes.transpose(0, 2, 1).reshape(3, 16, 4, 16, 2)  # [G, N, K/32, 16 bytes, 2 nibbles]
    blocks = (per_row[..., 0] | (per_row[..., 1] << 4)).astype(np.uint8)
    scales = np.asarray(quantised.scales).transpose(0, 2, 1)
    converted = mxfp4_from_blocks(blocks, scales)
    assert isinstance(converted, Mxfp4Experts)
    np.testing.assert_array_equal(np.asarray(converted.packed), np.asarray(quantised.packed))
    np.testing.assert_array_equal(np.asarray(converted.scales), np.asarray(quantised.scales))


def test_fp8_block_scales_keep_weights_within_e4m3_rounding():
    w = jnp.asarray(np.random.default_rng(6).standard_normal((2, 64, 64)), jnp.float32)
    restored = _dequantize(_quantize_fp8(w, (32, 32)))
    assert float(jnp.abs(restored - w).max() / jnp.abs(w).max()) < 0.07


def test_kernel_rejects_a_block_that_is_not_a_power_of_two():
    lhs, rhs = jnp.zeros((8, 32)), jnp.zeros((2, 32, 16))
    with pytest.raises(KernelShapeError, match="block_n=24"):
        grouped_matmul(lhs, rhs, jnp.asarray([4, 4], jnp.int32), block_n=24, interpret=True)
