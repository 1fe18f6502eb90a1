"""FP8 KV rows: float8_e4m3fn values and a float32 scale per row, packed into the KV buffer's words.

A row is one token's K or V of one KV head, or one token's MLA latent row. It is stored as `width`
e4m3 bytes, then its scale (the row's absolute maximum / 448) as 4 bytes, padded to whole words of the
buffer's dtype (`agentjax.kv.specs.fp8_row_bytes`). Writers quantise only the rows a step writes;
readers gather rows first and dequantise what they gathered: never bitcast a whole KV buffer (XLA
copies it). The arithmetic is elementwise per row, so a value's bits never depend on the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from agentjax.kv.specs import FP8_SCALE_BYTES, fp8_row_bytes

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def row_words(width: int, word_dtype) -> int:
    """Words of `word_dtype` one FP8 row of `width` values takes."""
    word = jnp.dtype(word_dtype).itemsize
    return fp8_row_bytes(width, word) // word


def quantize_rows(rows: Float[Array, "... width"], word_dtype) -> Array:
    """`rows` as FP8 rows packed into `[..., row_words(width)]` words of `word_dtype`."""
    width = rows.shape[-1]
    word = jnp.dtype(word_dtype).itemsize
    values = rows.astype(jnp.float32)
    amax = jnp.max(jnp.abs(values), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    quantized = jnp.clip(values / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    parts = [jax.lax.bitcast_convert_type(quantized, jnp.uint8), jax.lax.bitcast_convert_type(scale, jnp.uint8)
             .reshape(*rows.shape[:-1], FP8_SCALE_BYTES)]
    padding = fp8_row_bytes(width, word) - width - FP8_SCALE_BYTES
    if padding:
        parts.append(jnp.zeros((*rows.shape[:-1], padding), jnp.uint8))
    packed = jnp.concatenate(parts, axis=-1)
    if word == 1:
        return jax.lax.bitcast_convert_type(packed, word_dtype)
    return jax.lax.bitcast_convert_type(packed.reshape(*rows.shape[:-1], -1, word), word_dtype)


def dequantize_rows(words: Array, width: int) -> Float[Array, "... width"]:
    """float32 values of FP8 rows packed by `quantize_rows` (`words`: `[..., row_words(width)]`)."""
    packed = jax.lax.bitcast_convert_type(words, jnp.uint8)
    if packed.ndim > words.ndim:
        packed = packed.reshape(*words.shape[:-1], -1)
    values = jax.lax.bitcast_convert_type(packed[..., :width], FP8).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(packed[..., width:width + FP8_SCALE_BYTES], jnp.float32)
    return values * scale[..., None]


def load_rows(buffer: Array, index, width: int, fp8: bool) -> Float[Array, "... width"]:
    """`buffer[index]` as float32 rows of `width` values: dequantised FP8 rows, or the stored values."""
    rows = buffer[index]
    return dequantize_rows(rows, width) if fp8 else rows.astype(jnp.float32)


def store_rows(rows: Array, buffer_dtype, fp8: bool) -> Array:
    """What a writer scatters into a buffer of `buffer_dtype`: packed FP8 rows, or the rows cast."""
    return quantize_rows(rows, buffer_dtype) if fp8 else rows.astype(buffer_dtype)
