"""A quantised checkpoint matrix as recipes of its parts (`LazyQuant`): values, block scales, global scale.

Families convert it like any other tensor (`.T`, `np.stack` over experts, `np.concatenate` of gate and up,
splitting rows into groups) and every operation is applied to the parts so the blocks stay whole: an
operation that would cut a scale block (a concatenation of pieces that are not whole blocks, NVFP4
pieces with different global scales) raises an error naming the tensors. `region(index)` maps a region
of the logical (dequantised) matrix to the regions of the parts, which is how a device's shard is read
without decoding anything. `np.asarray` decodes on the host (float32). Host only: never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from agentjax.errors import UnsupportedModelError
from checkpoints import quant_codecs
from checkpoints.lazy_tensors import (
    _HANDLERS, Index, Joined, Lazy, Materialized, Shaped, _plain, full_index, normalize, region_shape, transpose_axes,
)
from checkpoints.quant_codecs import Codec


class BlockAlignmentError(ValueError):
    """A region or a join does not fall on the scale blocks of a quantised tensor."""


class LazyQuant(Shaped):
    """`values`, `scales` (None: float storage) and `global_scale` (shape `leading + (1, 1)`) recipes of a
    matrix (or a stack of them on leading axes) whose logical values are float32 of `shape`."""

    dtype = np.dtype(np.float32)

    def __init__(self, values: Lazy, scales: Lazy | None, global_scale: Lazy | None, codec: Codec,
                 shape: tuple[int, ...], origin: str):
        self.values, self.scales, self.global_scale = values, scales, global_scale
        self.codec, self.shape, self.origin = codec, tuple(shape), origin

    @property
    def parts(self) -> tuple:
        return self.values, self.scales, self.global_scale

    @property
    def nbytes(self) -> int:
        """Bytes stored (values and scales), not the logical float32 size."""
        return sum(p.nbytes for p in self.parts if p is not None)

    def entries(self):
        return [e for p in self.parts if p is not None for e in p.entries()]

    def _with(self, values, scales, global_scale, codec=None, shape=None) -> "LazyQuant":
        return LazyQuant(values, scales, global_scale, codec or self.codec, shape or self.shape, self.origin)

    # ---- structure
    def transpose(self, *axes) -> "LazyQuant":
        axes = transpose_axes(axes)
        n = self.ndim
        axes = tuple(a % n for a in axes)
        if set(axes[-2:]) != {n - 2, n - 1}:
            raise UnsupportedModelError(f"{self.origin}: a quantised tensor keeps its blocks on its last two axes; "
                                        f"transpose {axes} moves them")
        swap = axes[-2:] == (n - 1, n - 2)
        codec = self.codec.swapped() if swap else self.codec
        parts = [None if p is None else p.transpose(*axes) for p in self.parts]
        return self._with(*parts, codec=codec, shape=tuple(self.shape[a] for a in axes))

    def reshape(self, *shape) -> "LazyQuant":
        shape = self.reshape_target(shape)
        if shape == self.shape:
            return self
        # only the rows of a matrix split into (groups, rows): DeepSeek-V4's grouped output projection
        lead, rows, cols = self.shape[:-2], self.shape[-2], self.shape[-1]
        if len(shape) != self.ndim + 1 or shape[:-3] != lead or shape[-1] != cols or shape[-3] * shape[-2] != rows:
            raise UnsupportedModelError(f"{self.origin}: cannot reshape quantised {self.shape} to {shape}")
        groups, per_group = shape[-3], shape[-2]
        block = self.codec.block[0]
        if per_group % block or (self.codec.packed and self.codec.packed_axis == -2 and per_group % 2):
            raise UnsupportedModelError(f"{self.origin}: splitting {rows} rows into {groups} groups of {per_group} "
                                        f"cuts its scale blocks of {block} rows")
        values = self.values.reshape(*lead, groups, -1, self.values.shape[-1])
        scales = None if self.scales is None else self.scales.reshape(*lead, groups, -1, self.scales.shape[-1])
        glob = None
        if self.global_scale is not None:
            glob = np.stack([self.global_scale] * groups, axis=len(lead))
        return self._with(values, scales, glob, shape=shape)

    def __getitem__(self, index) -> "LazyQuant":
        items = index if isinstance(index, tuple) else (index,)
        dropped = {a for a, i in enumerate(items) if isinstance(i, (int, np.integer))}
        if dropped & {self.ndim - 2, self.ndim - 1}:
            raise UnsupportedModelError(f"{self.origin}: a quantised tensor keeps its last two axes")
        index = normalize(index, self.shape)
        regions = self.region(index)

        def cut(region):  # integer indices drop their (leading) axes, as numpy's do
            return tuple(s.start if a in dropped else s for a, s in enumerate(region))

        parts = [None if p is None else p[cut(r)] for p, r in zip(self.parts, regions)]
        shape = tuple(n for a, n in enumerate(region_shape(index)) if a not in dropped)
        return self._with(*parts, shape=shape)

    def region(self, index: Index) -> tuple[Index, Index | None, Index | None]:
        """The regions of values, scales and global scale behind a logical region whose bounds on the
        last two axes fall on scale blocks (and on byte pairs where E2M1 codes are packed)."""
        codec, n = self.codec, self.ndim
        values, scales = list(index), list(index)
        for axis, block in ((n - 2, codec.block[0]), (n - 1, codec.block[1])):
            s, size = index[axis], self.shape[axis]
            if s.start % block or (s.stop % block and s.stop != size):
                raise BlockAlignmentError(
                    f"{self.origin}: the range [{s.start}, {s.stop}) of axis {axis - n} (size {size}) cuts its scale "
                    f"blocks of {block}")
            scales[axis] = slice(s.start // block, -(-s.stop // block))
            if codec.packed and axis == n + codec.packed_axis:
                if s.start % 2 or s.stop % 2:
                    raise BlockAlignmentError(f"{self.origin}: the range [{s.start}, {s.stop}) splits packed E2M1 pairs")
                values[axis] = slice(s.start // 2, s.stop // 2)
        glob = tuple(index[:-2]) + (slice(0, 1), slice(0, 1))
        return (tuple(values), tuple(scales) if self.scales is not None else None,
                glob if self.global_scale is not None else None)

    # ---- values
    def read_region(self, index: Index) -> np.ndarray:
        """Float32 values of any logical region (read on whole blocks, decoded, cut)."""
        codec, n = self.codec, self.ndim
        aligned = list(index)
        for axis, block in ((n - 2, codec.block[0]), (n - 1, codec.block[1])):
            step = math.lcm(block, 2) if codec.packed and axis == n + codec.packed_axis else block
            s = index[axis]
            aligned[axis] = slice(s.start - s.start % step, min(self.shape[axis], -(-s.stop // step) * step))
        values, scales, glob = self.region(tuple(aligned))
        out = quant_codecs.dequantize(self.values.read(values), None if scales is None else self.scales.read(scales),
                                      None if glob is None else self.global_scale.read(glob), codec)
        return np.ascontiguousarray(out[tuple(slice(i.start - a.start, i.stop - a.start)
                                              for i, a in zip(index, aligned))])

    def dequantized(self) -> Lazy:
        return Dequantized(self)

    @staticmethod
    def join(arrays: Sequence[LazyQuant], axis: int, new_axis: bool) -> Lazy:
        """`np.stack` (`new_axis`) or `np.concatenate` of quantised tensors: `join_quant`."""
        return join_quant(arrays, axis, new_axis)

    def __array__(self, dtype=None, copy=None):
        return self.read_region(full_index(self.shape)).astype(dtype or np.float32, copy=False)

    def __array_function__(self, func, types, args, kwargs):
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        return func(*_plain(args), **_plain(kwargs))


class Dequantized(Lazy):
    """A LazyQuant read as float32 (where a quantised tensor meets plain ones)."""

    def __init__(self, quant: LazyQuant):
        self.quant, self.shape, self.dtype = quant, quant.shape, np.dtype(np.float32)

    def entries(self):
        return self.quant.entries()

    def read(self, index: Index) -> np.ndarray:
        return self.quant.read_region(index)


def join_quant(arrays: Sequence[LazyQuant], axis: int, new_axis: bool):
    """`np.stack` / `np.concatenate` of quantised tensors, part by part; tensors of different formats are
    joined as float32 instead."""
    first = arrays[0]
    if any(a.codec != first.codec for a in arrays):
        return Joined([a.dequantized() for a in arrays], axis, new_axis)
    n = first.ndim + (1 if new_axis else 0)
    axis %= n
    if new_axis:
        parts = [None if p is None else np.stack([a.parts[i] for a in arrays], axis=axis)
                 for i, p in enumerate(first.parts)]
        shape = (*first.shape[:axis], len(arrays), *first.shape[axis:])
        return first._with(*parts, shape=shape)
    names = ", ".join(a.origin for a in arrays[:3])
    if axis >= n - 2:
        block = first.codec.block[axis - (n - 2)]
        for a in arrays[:-1]:
            if a.shape[axis] % block:
                raise UnsupportedModelError(f"joining {names} along axis {axis} cuts scale blocks of {block} "
                                            f"({a.origin} has {a.shape[axis]})")
        glob = first.global_scale
        if glob is not None and not all(np.array_equal(np.asarray(a.global_scale), np.asarray(glob)) for a in arrays):
            raise UnsupportedModelError(f"joining {names} needs one global scale, and their weight_scale_2 differ")
        values = np.concatenate([a.values for a in arrays], axis=axis)
        scales = None if first.scales is None else np.concatenate([a.scales for a in arrays], axis=axis)
    else:
        values = np.concatenate([a.values for a in arrays], axis=axis)
        scales = None if first.scales is None else np.concatenate([a.scales for a in arrays], axis=axis)
        glob = None if first.global_scale is None else np.concatenate([a.global_scale for a in arrays], axis=axis)
    shape = list(first.shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    return first._with(values, scales, glob, shape=tuple(shape))


def global_scale_of(scalar: np.ndarray) -> Lazy:
    """A per-matrix global scale as the `(1, 1)` part recipes carry."""
    return Materialized(np.asarray(scalar, np.float32).reshape(1, 1))
