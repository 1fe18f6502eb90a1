"""Weights kept in a GGUF block format and dequantised inside the step (`BlockWeight`).

A GGUF file stores most matrices in blocks of 32 values: 4- or 8-bit integers with a float16 scale
(and, for Q4_1, a float16 minimum) per block. Dequantised to float32 at load, SmolLM2-135M's weights
take 4 bytes each, and a small-batch decode step spends its time reading them from DRAM. Kept as
blocks (1 byte of integer plus a scale and an offset per 32 values), the step reads about a quarter
of that, and a fusion dequantises each matrix just before its matmul.

The arithmetic is exact: a block's value is `q * scale + offset` in float32, where `q * scale` needs
at most 15 significant bits (an 8-bit integer times a float16), so the product is exact and the one
rounding is the add, the same rounding the float32 dequantisation at load does. The matmuls therefore
see bit-identical float32 weights; only the bytes read differ.

`BlockWeight` is a pytree whose `[...]` gives the float32 matrix, so a `Linear` reads it like an
array, and whose `__array__` dequantises on the host, so code that turns parameters into numpy (a
parallel layout, a checkpoint writer) sees plain float32. `take_rows` and `project` are the two uses
that must not dequantise a whole embedding table: a token lookup and a tied LM head.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from agentjax.numerics import dense

BLOCK = 32  # values per block in every format kept here (Q4_0, Q4_1, Q8_0)
# An LM head is dequantised this many output rows at a time (4.7 MB of float32 at SmolLM2's width,
# 5.2 MB at Gemma-3's), so the dequantised rows stay in cache between the fusion that makes them and
# the matmul. Measured on a 2-core EPYC, step time at 1024 to 4096 rows alike; at 6144, Gemma-3-270M's
# decode step took 1.5x as long as at 2048 (1.2x its float32 step).
HEAD_CHUNK_ROWS = 2048
_PARTS = ("q", "scale", "offset")
_SEPARATOR = "#"  # flat names of the parts: "lm_head#q", "lm_head#scale", ...


class EncodedWeight:
    """A weight kept encoded, as a pytree of its parts: `weight[...]` decodes it whole (inside a step),
    `np.asarray(weight)` decodes it on the host. A subclass gives `dequantize(xp)`."""

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is read whole (weight[...]); use take_rows for rows")
        return self.dequantize()

    def __array__(self, dtype=None, copy=None):
        values = jax.tree.map(np.asarray, self).dequantize(np)
        return values if dtype is None else values.astype(dtype)


@jax.tree_util.register_pytree_node_class
class BlockWeight(EncodedWeight):
    """`q * scale + offset` per block of `BLOCK` values along `axis` (-1 or -2); offset None means 0.

    `q` holds the integers (uint8 for 4-bit values, int8 for Q8_0), `scale` and `offset` are float32
    with the blocked axis divided by `BLOCK`. Any leading axes (a layer stack) are shared by all three.
    """

    def __init__(self, q, scale, offset=None, axis: int = -1):
        self.q, self.scale, self.offset = q, scale, offset
        self.axis = axis if axis < 0 else axis - len(np.shape(q))
        if self.axis not in (-1, -2):
            raise ValueError(f"a BlockWeight is blocked along one of its last two axes, not {axis}")

    def tree_flatten(self):
        return (self.q, self.scale, self.offset), self.axis

    @classmethod
    def tree_unflatten(cls, axis, children):
        return cls(*children, axis=axis)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return np.dtype(np.float32)

    def parts(self) -> tuple:
        return self.q, self.scale, self.offset

    def dequantize(self, xp=jnp) -> Float[Array, "..."]:
        """The float32 matrix (`xp` is jnp inside a step, numpy on the host)."""
        q = self.q.astype(xp.float32)
        if self.axis == -1:
            blocks = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
            scale = self.scale[..., None]
            offset = None if self.offset is None else self.offset[..., None]
        else:
            blocks = q.reshape(*q.shape[:-2], q.shape[-2] // BLOCK, BLOCK, q.shape[-1])
            scale = self.scale[..., None, :]
            offset = None if self.offset is None else self.offset[..., None, :]
        values = blocks * scale if offset is None else blocks * scale + offset
        return values.reshape(q.shape)

    def map_parts(self, fn) -> "BlockWeight":
        """`fn` applied to each part; it must act on an axis that is not blocked (a row permutation)."""
        return BlockWeight(*(None if part is None else fn(part) for part in self.parts()), axis=self.axis)

    def swap_last_axes(self) -> "BlockWeight":
        """The transposed matrix ([out, in] to [in, out]): the blocks move to the other axis."""
        swap = lambda part: np.ascontiguousarray(np.swapaxes(part, -1, -2))  # noqa: E731
        return BlockWeight(*(None if p is None else swap(p) for p in self.parts()), axis=-3 - self.axis)

    def to_device(self) -> "BlockWeight":
        return BlockWeight(*(None if p is None else jnp.asarray(p) for p in self.parts()), axis=self.axis)

    @staticmethod
    def stack(weights: Sequence["BlockWeight"]) -> "BlockWeight":
        """One BlockWeight with a leading axis over `weights` (all of one format)."""
        first = weights[0]
        parts = [None if first.offset is None and i == 2 else jnp.stack([w.parts()[i] for w in weights])
                 for i in range(3)]
        return BlockWeight(*parts, axis=first.axis)

    def same_format(self, other) -> bool:
        return (isinstance(other, BlockWeight) and other.axis == self.axis and other.shape == self.shape
                and np.dtype(other.q.dtype) == np.dtype(self.q.dtype) and (other.offset is None) == (self.offset is None))


def take_rows(table, ids: Int[Array, " n"]) -> Float[Array, "n dim"]:
    """Rows `ids` of an embedding table (an array, a BlockWeight blocked along its rows, or a checkpoint's
    stored weight: agentjax.models.quantized)."""
    if hasattr(table, "take_rows"):
        return table.take_rows(ids)
    if not isinstance(table, BlockWeight):
        return jnp.take(table, ids, axis=0)
    if table.axis != -1:
        raise ValueError("take_rows needs a table blocked along its rows (axis -1)")
    rows = BlockWeight(*(None if p is None else jnp.take(p, ids, axis=0) for p in table.parts()), axis=-1)
    return rows.dequantize()


def project(x: Float[Array, "rows k"], weight, numerics: str, *, transposed: bool = False) -> Float[Array, "rows n"]:
    """`x @ weight` (`x @ weight.T` with `transposed`: a tied embedding [n, k]). A BlockWeight with more
    output columns than `HEAD_CHUNK_ROWS` (an LM head) is dequantised that many columns at a time."""
    if not isinstance(weight, BlockWeight):
        weight = weight[...]  # a stored weight (agentjax.models.quantized) decodes here
        return dense(x, weight.T if transposed else weight, numerics)
    out_axis = -2 if transposed else -1

    def columns_of(part, start, stop):  # the parts' slice of output columns (scale and offset alike)
        return part[start:stop] if transposed else part[:, start:stop]

    def matmul(parts):
        matrix = BlockWeight(*parts, axis=weight.axis).dequantize()
        return dense(x, matrix.T if transposed else matrix, numerics)

    columns = weight.shape[out_axis]
    chunks, rest = divmod(columns, HEAD_CHUNK_ROWS)
    if chunks <= 1:
        return matmul(weight.parts())
    whole = chunks * HEAD_CHUNK_ROWS

    def split(part):  # [n, k] -> [chunks, rows, k] (transposed), or [k, n] -> [chunks, k, rows]
        part = columns_of(part, 0, whole)
        if transposed:
            return part.reshape(chunks, HEAD_CHUNK_ROWS, part.shape[-1])
        return jnp.moveaxis(part.reshape(part.shape[0], chunks, HEAD_CHUNK_ROWS), 1, 0)

    out = jax.lax.map(matmul, tuple(None if p is None else split(p) for p in weight.parts()))
    out = jnp.moveaxis(out, 0, 1).reshape(x.shape[0], whole)  # [chunks, rows, R] -> [rows, chunks * R]
    if rest:
        tail = matmul(tuple(None if p is None else columns_of(p, whole, columns) for p in weight.parts()))
        out = jnp.concatenate([out, tail], axis=1)
    return out


def flatten_blocks(arrays: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Plain arrays for a cache entry: each BlockWeight becomes `name#q`, `name#scale` (and `name#offset`)."""
    flat = {}
    for name, value in arrays.items():
        if isinstance(value, BlockWeight):
            if value.ndim != 2:
                raise ValueError(f"{name}: only 2-D block weights are cached, got {value.shape}")
            for part_name, part in zip(_PARTS, value.parts()):
                if part is not None:
                    flat[f"{name}{_SEPARATOR}{part_name}"] = np.asarray(part)
        else:
            flat[name] = value
    return flat


def unflatten_blocks(flat: Mapping[str, np.ndarray]) -> dict[str, object]:
    """The inverse of `flatten_blocks`; a part's blocked axis is the one its scale divides by `BLOCK`."""
    arrays: dict[str, object] = {}
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, value in flat.items():
        if _SEPARATOR in name:
            base, part = name.rsplit(_SEPARATOR, 1)
            parts.setdefault(base, {})[part] = value
        else:
            arrays[name] = value
    for base, found in parts.items():
        if "q" not in found or "scale" not in found:
            raise ValueError(f"{base}: a cached block weight needs its q and scale parts, found {sorted(found)}")
        q, scale = found["q"], found["scale"]
        if scale.shape == (q.shape[0], q.shape[1] // BLOCK):
            axis = -1
        elif scale.shape == (q.shape[0] // BLOCK, q.shape[1]):
            axis = -2
        else:
            raise ValueError(f"{base}: scale shape {scale.shape} does not fit blocks of {BLOCK} in {q.shape}")
        arrays[base] = BlockWeight(q, scale, found.get("offset"), axis=axis)
    return arrays
