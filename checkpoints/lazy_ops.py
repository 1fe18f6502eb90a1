"""The nodes of checkpoint recipes (checkpoints/lazy_tensors.py): transposes, slices, stacks and
concatenations, axis splits, dropped axes and elementwise maps, each reading the region it is asked for
from its children; and the numpy functions (`np.stack`, `np.concatenate`, ...) that build them. Host
only: never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from checkpoints.lazy_tensors import Index, Lazy, as_lazy, region_shape


class Transpose(Lazy):
    def __init__(self, child: Lazy, axes: tuple[int, ...]):
        self.child, self.axes = child, axes
        self.shape, self.dtype = tuple(child.shape[a] for a in axes), child.dtype

    def entries(self):
        return self.child.entries()

    def _child_index(self, index: Index) -> Index:
        child_index = [None] * len(self.axes)
        for position, axis in enumerate(self.axes):
            child_index[axis] = index[position]
        return tuple(child_index)

    def read(self, index: Index) -> np.ndarray:
        return np.ascontiguousarray(self.child.read(self._child_index(index)).transpose(self.axes))

    def read_into(self, out: np.ndarray, index: Index) -> None:
        out[...] = self.child.read(self._child_index(index)).transpose(self.axes)


class Slice(Lazy):
    def __init__(self, child: Lazy, index: Index):
        self.child, self.index = child, index
        self.shape, self.dtype = region_shape(index), child.dtype

    def entries(self):
        return self.child.entries()

    def read(self, index: Index) -> np.ndarray:
        return self.child.read(tuple(slice(o.start + i.start, o.start + i.stop) for o, i in zip(self.index, index)))


class Joined(Lazy):
    """Children stacked on a new axis (`new_axis`) or concatenated along an existing one."""

    def __init__(self, children: Sequence[Lazy], axis: int, new_axis: bool):
        self.children, self.new_axis = [as_lazy(c) for c in children], new_axis
        first = self.children[0].shape
        self.axis = axis % (len(first) + (1 if new_axis else 0))
        self.dtype = np.result_type(*[c.dtype for c in self.children])
        if new_axis:
            self.shape = (*first[:self.axis], len(self.children), *first[self.axis:])
            self.offsets = list(range(len(self.children) + 1))
        else:
            self.offsets = [0, *np.cumsum([c.shape[self.axis] for c in self.children]).tolist()]
            self.shape = (*first[:self.axis], self.offsets[-1], *first[self.axis + 1:])

    def entries(self):
        return [e for c in self.children for e in c.entries()]

    def read(self, index: Index) -> np.ndarray:
        out = np.empty(region_shape(index), self.dtype)
        self.read_into(out, index)
        return out

    def read_into(self, out: np.ndarray, index: Index) -> None:
        want = index[self.axis]
        for child, begin, end in zip(self.children, self.offsets, self.offsets[1:]):
            lo, hi = max(want.start, begin), min(want.stop, end)
            if lo >= hi:
                continue
            target = (slice(None),) * self.axis + (lo - want.start if self.new_axis else slice(lo - want.start, hi - want.start),)
            if self.new_axis:
                sub = index[:self.axis] + index[self.axis + 1:]
            else:
                sub = index[:self.axis] + (slice(lo - begin, hi - begin),) + index[self.axis + 1:]
            view = out[target]
            if child.dtype == self.dtype:
                child.read_into(view, sub)
            else:
                view[...] = child.read(sub)


class SplitAxis(Lazy):
    """`axis` of the child split into `parts` (a reshape that only splits one axis)."""

    def __init__(self, child: Lazy, axis: int, parts: tuple[int, ...]):
        self.child, self.axis, self.parts = child, axis, parts
        self.shape = (*child.shape[:axis], *parts, *child.shape[axis + 1:])
        self.dtype = child.dtype

    def entries(self):
        return self.child.entries()

    def read(self, index: Index) -> np.ndarray:
        span = index[self.axis:self.axis + len(self.parts)]
        inner = math.prod(self.parts[1:])
        first = span[0]
        child_index = index[:self.axis] + (slice(first.start * inner, first.stop * inner),) + \
            index[self.axis + len(self.parts):]
        block = self.child.read(child_index)
        block = block.reshape(*block.shape[:self.axis], first.stop - first.start, *self.parts[1:],
                              *block.shape[self.axis + 1:])
        cut = (slice(None),) * (self.axis + 1) + tuple(span[1:])
        return np.ascontiguousarray(block[cut])


class DropAxes(Lazy):
    """The child without some of its size-1 axes (what an integer index leaves)."""

    def __init__(self, child: Lazy, axes: tuple[int, ...]):
        self.child, self.axes = child, axes
        self.shape = tuple(n for a, n in enumerate(child.shape) if a not in axes)
        self.dtype = child.dtype

    def entries(self):
        return self.child.entries()

    def read(self, index: Index) -> np.ndarray:
        full, rest = [], iter(index)
        for a in range(self.child.ndim):
            full.append(slice(0, 1) if a in self.axes else next(rest))
        return self.child.read(tuple(full)).reshape(region_shape(index))


class Map(Lazy):
    """An elementwise function of the child's values (a dtype change, Gemma's `1 + w`)."""

    def __init__(self, child: Lazy, fn, dtype: np.dtype):
        self.child, self.fn, self.dtype = child, fn, np.dtype(dtype)
        self.shape = child.shape

    def entries(self):
        return self.child.entries()

    def read(self, index: Index) -> np.ndarray:
        return np.asarray(self.fn(self.child.read(index)), self.dtype)


def _stack(arrays, axis=0, **_):
    from checkpoints.lazy_quant import LazyQuant, join_quant

    if all(isinstance(a, LazyQuant) for a in arrays):
        return join_quant(arrays, axis, new_axis=True)
    return Joined([_float(a) for a in arrays], axis, new_axis=True)


def _concatenate(arrays, axis=0, **_):
    from checkpoints.lazy_quant import LazyQuant, join_quant

    if all(isinstance(a, LazyQuant) for a in arrays):
        return join_quant(arrays, axis, new_axis=False)
    return Joined([_float(a) for a in arrays], axis, new_axis=False)


def _float(value) -> Lazy:
    """A recipe of float values (a quantised operand mixed with plain ones is read dequantised)."""
    return value.dequantized() if hasattr(value, "codec") else as_lazy(value)


_HANDLERS = {
    np.stack: _stack,
    np.concatenate: _concatenate,
    np.ascontiguousarray: lambda a, dtype=None: a if dtype is None else a.astype(dtype),
    np.transpose: lambda a, axes=None: a.transpose(*(axes or reversed(range(a.ndim)))),
    np.swapaxes: lambda a, x, y: a.transpose(*[y if i == x % a.ndim else x if i == y % a.ndim else i
                                               for i in range(a.ndim)]),
    np.reshape: lambda a, shape, **_: a.reshape(shape),
    np.shape: lambda a: a.shape,
    np.ndim: lambda a: a.ndim,
}
