"""Checkpoint tensors as recipes read on demand: a region of a converted parameter reads only its bytes.

A family's conversion (transposes, gate|up concatenation, stacking experts, splitting an axis) runs on
`Lazy` objects instead of arrays: `take` hands out a `Source` (one safetensors tensor, lazy_reads.py), numpy's
`np.stack` / `np.concatenate` / `.T` / slicing build the recipe nodes below, and `read(index)` later fetches
the bytes one region needs with `os.pread` (a device's shard of a parameter, say), so no process holds a
whole model. Anything a recipe cannot express lazily (an arbitrary reshape, a value check) reads the
tensor whole as float32, as a plain array would. Host only: never imports jax.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from checkpoints.safetensors_reader import TensorEntry

Index = tuple[slice, ...]


def full_index(shape: Sequence[int]) -> Index:
    return tuple(slice(0, n) for n in shape)


def normalize(index, shape: Sequence[int]) -> Index:
    """`index` (ints, slices with step 1, Ellipsis) as one slice per axis; ints keep their axis."""
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for item, n in zip(index, shape):
        if isinstance(item, (int, np.integer)):
            item = slice(int(item) % n, int(item) % n + 1)
        start, stop, step = item.indices(n)
        if step != 1:
            raise IndexError("lazy checkpoint tensors take slices with step 1")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def region_shape(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


def transpose_axes(axes: tuple) -> tuple[int, ...]:
    """`transpose`'s (or `reshape`'s) arguments as numpy takes them (`t.transpose(1, 0)` or
    `t.transpose((1, 0))`), as one tuple."""
    return tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else tuple(axes)


class Shaped:
    """What a lazy tensor's numpy surface derives from its `shape` alone."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def T(self):
        return self.transpose(*reversed(range(self.ndim)))

    def reshape_target(self, shape: tuple) -> tuple[int, ...]:
        """`reshape`'s arguments as numpy takes them, with a -1 resolved from `size`."""
        shape = transpose_axes(shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
        return shape


class Lazy(Shaped):
    """A tensor known by shape and dtype whose values are read region by region (`read`)."""

    dtype: np.dtype

    def read(self, index: Index) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, out: np.ndarray, index: Index) -> None:
        """`out[...] = self.read(index)`; nodes that can write straight into `out` skip the extra copy."""
        out[...] = self.read(index)

    def entries(self) -> list[TensorEntry]:
        """The safetensors tensors this recipe reads from."""
        return []

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def materialize(self) -> np.ndarray:
        return self.read(full_index(self.shape))

    # ---- the numpy surface the families use
    def __array__(self, dtype=None, copy=None):
        values = self.materialize()
        return values.astype(dtype or np.float32, copy=False)

    def transpose(self, *axes) -> "Lazy":
        axes = transpose_axes(axes)
        return self if axes == tuple(range(self.ndim)) else Transpose(self, axes)

    def __getitem__(self, index) -> "Lazy":
        items = index if isinstance(index, tuple) else (index,)
        if Ellipsis in items or any(i is None for i in items):
            return Materialized(np.asarray(self)[index])
        dropped = tuple(a for a, i in enumerate(items) if isinstance(i, (int, np.integer)))
        sliced = Slice(self, normalize(index, self.shape))
        return DropAxes(sliced, dropped) if dropped else sliced

    def reshape(self, *shape) -> "Lazy":
        shape = self.reshape_target(shape)
        if shape == self.shape:
            return self
        split = _split_of(self.shape, shape)
        if split is not None:
            return SplitAxis(self, *split)
        return Materialized(np.asarray(self).reshape(shape))

    def astype(self, dtype, copy=True) -> "Lazy":
        dtype = np.dtype(dtype)
        return self if dtype == self.dtype else Map(self, lambda a: a.astype(dtype), dtype)

    def __add__(self, other) -> "Lazy":
        if np.isscalar(other):
            return Map(self, lambda a: a.astype(np.float32) + np.float32(other), np.dtype(np.float32))
        return np.asarray(self) + other

    __radd__ = __add__

    def __getattr__(self, name):  # min, max, tolist, ...: on the values, read whole
        if name not in _VALUE_METHODS:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(np.asarray(self), name)

    def __eq__(self, other):
        return np.asarray(self) == (np.asarray(other) if isinstance(other, Lazy) else other)

    __hash__ = object.__hash__

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [np.asarray(i) if isinstance(i, Lazy) else i for i in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        return func(*_plain(args), **_plain(kwargs))


_VALUE_METHODS = frozenset({"min", "max", "sum", "mean", "any", "all", "tolist", "item", "copy", "flatten", "ravel"})


def _plain(value):
    if isinstance(value, Lazy):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _split_of(old: tuple[int, ...], new: tuple[int, ...]):
    """`(axis, parts)` when `new` splits one axis of `old` into several (or adds size-1 axes there)."""
    for axis in range(len(old)):
        extra = len(new) - len(old) + 1
        if extra < 1 or new[:axis] != old[:axis] or new[axis + extra:] != old[axis + 1:]:
            continue
        parts = new[axis:axis + extra]
        if math.prod(parts) == old[axis]:
            return axis, tuple(parts)
    return None


def as_lazy(value) -> Lazy:
    return value if isinstance(value, Lazy) or hasattr(value, "codec") else Materialized(np.asarray(value))


class Materialized(Lazy):
    """A host array posing as a recipe (small tensors, values a family computed)."""

    def __init__(self, array: np.ndarray):
        self.array = np.asarray(array)
        self.shape, self.dtype = tuple(self.array.shape), self.array.dtype

    def read(self, index: Index) -> np.ndarray:
        return np.ascontiguousarray(self.array[index])


# ---- the recipe nodes the numpy surface builds: transposes, slices, stacks and concatenations, axis
# splits, dropped axes and elementwise maps, each reading the region it is asked for from its children

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


def _join(arrays, axis: int, new_axis: bool) -> Lazy:
    """Quantised tensors (checkpoints/lazy_quant.py) join part by part, by their own `join`; anything else
    joins as float values."""
    if all(hasattr(a, "codec") for a in arrays):
        return arrays[0].join(arrays, axis, new_axis)
    return Joined([_float(a) for a in arrays], axis, new_axis)


def _stack(arrays, axis=0, **_):
    return _join(arrays, axis, new_axis=True)


def _concatenate(arrays, axis=0, **_):
    return _join(arrays, axis, new_axis=False)


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
