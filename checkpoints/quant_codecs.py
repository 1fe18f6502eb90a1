"""The number formats of quantised checkpoints: decoding (numpy or jnp) and encoding (numpy, for test checkpoints).

A quantised matrix is `values` (E4M3 bytes, or E2M1 codes two to a byte, the even element in the low
nibble), `scales` per block of `block = (rows, cols)` values (float32, E8M0 or E4M3) and, for NVFP4,
one float32 global scale. `dequantize(...)` rebuilds float32 the same way on the host (numpy) and inside
a step (jnp): codes and scales decode exactly, then `values * scale` and `* global` are one float32
rounding each, in that order, so the host's float32 copy of a checkpoint and the device's step see
bit-identical weights. Encoders exist to write synthetic checkpoints. Host module: never imports jax
(callers pass `xp=jax.numpy`).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Magnitudes of the E2M1 codes 0..7; bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_TABLE = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)


@dataclass(frozen=True)
class Codec:
    """How one matrix's parts encode numbers: `values` "e4m3", "e2m1" (packed pairs) or "float" (no scales);
    `scales` "f32", "e8m0" or "e4m3"; `block` the (rows, cols) a scale covers; `global_scale` for NVFP4.
    Rows and columns are those of the stored matrix's last two axes; `packed_axis` (-1 or -2) is where
    E2M1 pairs sit."""

    values: str
    scales: str | None = None
    block: tuple[int, int] = (1, 1)
    global_scale: bool = False
    packed_axis: int = -1

    @property
    def packed(self) -> bool:
        return self.values == "e2m1"

    def swapped(self) -> "Codec":
        """The codec of the transposed matrix (last two axes swapped)."""
        return Codec(self.values, self.scales, (self.block[1], self.block[0]), self.global_scale,
                     -3 - self.packed_axis)

    def value_shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        """The stored values' shape for a logical (unpacked) shape."""
        if not self.packed:
            return tuple(logical)
        shape = list(logical)
        shape[self.packed_axis] //= 2
        return tuple(shape)

    def scale_shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        rows, cols = logical[-2:]
        return (*logical[:-2], -(-rows // self.block[0]), -(-cols // self.block[1]))


def scale_dtype(kind: str) -> np.dtype:
    return {"f32": np.dtype(np.float32), "e8m0": E8M0, "e4m3": E4M3}[kind]


def unpack_e2m1(packed, axis: int, xp=np):
    """E2M1 codes (uint8, 0..15) from bytes holding two along `axis` (even element in the low nibble)."""
    packed = packed.astype(xp.uint8)
    low, high = packed & 15, packed >> 4
    axis = axis % packed.ndim
    pairs = xp.stack([low, high], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return pairs.reshape(shape)


def decode_values(values, codec: Codec, xp=np):
    """The float32 values before scaling (E2M1 codes looked up, E4M3 and floats widened: all exact)."""
    if codec.packed:
        codes = unpack_e2m1(values, codec.packed_axis, xp)
        return xp.asarray(E2M1_TABLE)[codes.astype(xp.int32)]
    return values.astype(xp.float32)


def _expand(scales, block: tuple[int, int], shape: tuple[int, ...], xp):
    """Each scale repeated over its block, cut to the matrix's shape (the last block may be partial)."""
    rows, cols = shape[-2:]
    scales = xp.repeat(scales, block[0], axis=-2)[..., :rows, :]
    return xp.repeat(scales, block[1], axis=-1)[..., :cols]


def dequantize(values, scales, global_scale, codec: Codec, xp=np):
    """Float32 weights from their stored parts (see the module docstring for the rounding)."""
    out = decode_values(values, codec, xp)
    if codec.scales is None:
        return out
    out = out * _expand(scales.astype(xp.float32), codec.block, out.shape, xp)
    if codec.global_scale:
        out = out * global_scale.astype(xp.float32)
    return out


# ------------------------------------------------------------------ encoders (synthetic checkpoints)


def encode_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each value (magnitudes past 6 saturate); uint8 codes 0..15."""
    magnitude = np.abs(x)
    codes = np.zeros(x.shape, np.uint8)
    for low, high in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:]):
        codes += (magnitude > (low + high) / 2).astype(np.uint8)
    return codes | np.where(x < 0, 8, 0).astype(np.uint8)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """Two codes per byte along the last axis (even element low); the axis must have an even length."""
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 codes pack in pairs; the last axis has {codes.shape[-1]}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = w.shape
    pad_rows, pad_cols = (-rows) % block[0], (-cols) % block[1]
    padded = np.pad(np.abs(w), ((0, pad_rows), (0, pad_cols)))
    tiles = padded.reshape(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    return tiles.max(axis=(1, 3))


def encode(w: np.ndarray, kind: str, block: tuple[int, int] = (128, 128), global_scale: float | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`(values, scales, global_scale)` of a float `[out, in]` matrix in one published format:
    "fp8" (E4M3, float32 scales per `block`), "fp8_ue8m0" (the same with power-of-two E8M0 scales),
    "mxfp8" (E4M3, E8M0 per 32 along in), "mxfp4" (packed E2M1, E8M0 per 32), "nvfp4" (packed E2M1, E4M3
    per 16, float32 global: `global_scale` or amax / (6 * 448))."""
    w = np.asarray(w, np.float32)
    if kind in ("fp8", "fp8_ue8m0"):
        amax = np.maximum(_block_amax(w, block), 1e-12)
        scale = amax / E4M3_MAX
        if kind == "fp8_ue8m0":
            scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
        expanded = _expand(scale.astype(np.float32), block, w.shape, np)
        values = np.clip(w / expanded, -E4M3_MAX, E4M3_MAX).astype(E4M3)
        return values, scale.astype(np.float32 if kind == "fp8" else E8M0), None
    if kind in ("mxfp8", "mxfp4"):
        amax = _block_amax(w, (1, 32))
        emax = 8 if kind == "mxfp8" else 2  # largest exponent of E4M3 and E2M1
        exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - emax, -127)
        exponent = np.clip(exponent, -127, 127)
        scale = np.exp2(exponent).astype(np.float32)
        scaled = w / _expand(scale, (1, 32), w.shape, np)
        if kind == "mxfp8":
            values = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(E4M3)
        else:
            values = pack_e2m1(encode_e2m1(scaled))
        return values, scale.astype(E8M0), None
    if kind == "nvfp4":
        glob = np.float32(global_scale if global_scale is not None else max(np.abs(w).max(), 1e-12) / (E2M1_MAX * E4M3_MAX))
        block_scale = (_block_amax(w, (1, 16)) / E2M1_MAX / glob).astype(E4M3)
        effective = block_scale.astype(np.float32) * glob
        expanded = _expand(effective, (1, 16), w.shape, np)
        codes = encode_e2m1(np.where(expanded > 0, w / np.where(expanded > 0, expanded, 1), 0))
        return pack_e2m1(codes), block_scale, np.asarray(glob, np.float32)
    raise ValueError(f"unknown format {kind!r}")
