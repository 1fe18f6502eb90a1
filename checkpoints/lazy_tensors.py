"""Checkpoint tensors as recipes read on demand: a region of a converted parameter reads only its bytes.

A family's conversion (transposes, gate|up concatenation, stacking experts, splitting an axis) runs on
`Lazy` objects instead of arrays: `take` hands out a `Source` (one safetensors tensor), numpy's
`np.stack` / `np.concatenate` / `.T` / slicing build recipe nodes, and `read(index)` later fetches the
bytes one region needs with `os.pread` (a device's shard of a parameter, say), so no process holds a
whole model. Anything a recipe cannot express lazily (an arbitrary reshape, a value check) reads the
tensor whole as float32, as a plain array would. Host only: never imports jax.
"""
from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence

import numpy as np

from agentjax.errors import CorruptCheckpointError
from checkpoints.safetensors_reader import TensorEntry

Index = tuple[slice, ...]
# Runs of bytes shorter than this are widened to whole rows when that reads at most 4x the bytes asked for:
# fewer system calls for strided regions (a row-parallel shard of an [out, in] weight).
SMALL_RUN_BYTES = 64 * 1024


class FileReads:
    """Open files and a count of the bytes read through them (shared by every `Source`)."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def fd(self, path) -> int:
        key = str(path)
        with self._lock:
            if key not in self._fds:
                self._fds[key] = os.open(key, os.O_RDONLY)
            return self._fds[key]

    def pread_into(self, entry: TensorEntry, buffer: memoryview, offset: int) -> None:
        got = os.preadv(self.fd(entry.file), [buffer], offset)
        if got != len(buffer):
            raise CorruptCheckpointError(f"safetensors file {entry.file} is truncated: tensor {entry.name!r} "
                                         f"needs bytes up to {offset + len(buffer)}, the file ended first")
        with self._lock:
            self.bytes_read += got

    def pread_runs(self, entry: TensorEntry, buffer: memoryview, offsets: list[int], run_bytes: int) -> None:
        """`len(offsets)` runs of `run_bytes` from the file, one after another into `buffer`."""
        fd = self.fd(entry.file)
        for n, offset in enumerate(offsets):
            view = buffer[n * run_bytes:(n + 1) * run_bytes]
            if os.preadv(fd, [view], offset) != run_bytes:
                raise CorruptCheckpointError(f"safetensors file {entry.file} is truncated: tensor {entry.name!r} "
                                             f"needs bytes up to {offset + run_bytes}, the file ended first")
        with self._lock:
            self.bytes_read += run_bytes * len(offsets)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


READS = FileReads()


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


class Lazy:
    """A tensor known by shape and dtype whose values are read region by region (`read`)."""

    shape: tuple[int, ...]
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
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def materialize(self) -> np.ndarray:
        return self.read(full_index(self.shape))

    # ---- the numpy surface the families use
    def __array__(self, dtype=None, copy=None):
        values = self.materialize()
        return values.astype(dtype or np.float32, copy=False)

    @property
    def T(self) -> "Lazy":
        return self.transpose(*reversed(range(self.ndim)))

    def transpose(self, *axes) -> "Lazy":
        axes = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else tuple(axes)
        return self if axes == tuple(range(self.ndim)) else Transpose(self, axes)

    def __getitem__(self, index) -> "Lazy":
        items = index if isinstance(index, tuple) else (index,)
        if Ellipsis in items or any(i is None for i in items):
            return Materialized(np.asarray(self)[index])
        dropped = tuple(a for a, i in enumerate(items) if isinstance(i, (int, np.integer)))
        sliced = Slice(self, normalize(index, self.shape))
        return DropAxes(sliced, dropped) if dropped else sliced

    def reshape(self, *shape) -> "Lazy":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else tuple(shape)
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // known if n == -1 else n for n in shape)
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


class Source(Lazy):
    """One tensor of a safetensors file; `read` fetches the contiguous byte runs a region covers."""

    def __init__(self, entry: TensorEntry, reads: FileReads = READS):
        self.entry, self.reads = entry, reads
        self.shape, self.dtype = tuple(entry.shape), entry.dtype

    def entries(self) -> list[TensorEntry]:
        return [self.entry]

    def read(self, index: Index) -> np.ndarray:
        shape, itemsize = self.shape, self.dtype.itemsize
        if not shape:
            out = np.empty((), self.dtype)
            self.reads.pread_into(self.entry, memoryview(out.reshape(1).view(np.uint8)), self.entry.offset)
            return out
        wanted = region_shape(index)
        if 0 in wanted:
            return np.zeros(wanted, self.dtype)
        fetch = list(index)
        # the innermost axis whose range is partial; axes after it are read whole
        k = max((a for a, s in enumerate(fetch) if (s.start, s.stop) != (0, shape[a])), default=0)
        while k > 0:
            run = (fetch[k].stop - fetch[k].start) * math.prod(shape[k + 1:]) * itemsize
            if run >= SMALL_RUN_BYTES or 4 * (fetch[k].stop - fetch[k].start) < 3 * shape[k]:
                break
            fetch[k] = slice(0, shape[k])  # widen to whole rows (a quarter read in vain at most), cut below
            k = max((a for a in range(k) if (fetch[a].start, fetch[a].stop) != (0, shape[a])), default=0)
        out = np.empty(region_shape(fetch), self.dtype)
        run_bytes = (fetch[k].stop - fetch[k].start) * math.prod(shape[k + 1:]) * itemsize
        strides = [math.prod(shape[a + 1:]) * itemsize for a in range(len(shape))]
        offsets = np.asarray(self.entry.offset + fetch[k].start * strides[k], np.int64)
        for a in range(k):  # the byte offset of every run, outer axes in order
            offsets = np.add.outer(offsets, np.arange(fetch[a].start, fetch[a].stop, dtype=np.int64) * strides[a])
        self.reads.pread_runs(self.entry, memoryview(out.reshape(-1).view(np.uint8)), offsets.reshape(-1).tolist(),
                              run_bytes)
        inner = tuple(slice(i.start - f.start, i.stop - f.start) for i, f in zip(index, fetch))
        return out if tuple(fetch) == tuple(index) else np.ascontiguousarray(out[inner])


    def read_into(self, out: np.ndarray, index: Index) -> None:
        shape = self.shape
        partial = [a for a, s in enumerate(index) if (s.start, s.stop) != (0, shape[a])]
        contiguous = not partial or all(index[a].stop - index[a].start == 1 for a in partial[:-1])
        if not (contiguous and out.flags.c_contiguous and out.dtype == self.dtype and shape):
            out[...] = self.read(index)
            return
        start = sum(index[a].start * math.prod(shape[a + 1:]) for a in range(len(shape)))
        self.reads.pread_into(self.entry, memoryview(out.reshape(-1).view(np.uint8)),
                              self.entry.offset + start * self.dtype.itemsize)


# The structural nodes live in lazy_ops.py (imported last: they subclass Lazy).
from checkpoints.lazy_ops import _HANDLERS, DropAxes, Joined, Map, Slice, SplitAxis, Transpose  # noqa: E402,F401
