"""Reading a checkpoint's bytes: `Source`, one safetensors tensor as a recipe (checkpoints/lazy_tensors.py)
that fetches only the byte runs a region covers with `os.pread`, and `FileReads`, the open files and the count
of bytes read through them (`READS`, shared by every `Source`). Host only: never imports jax.
"""
from __future__ import annotations

import math
import os
import threading

import numpy as np

from agentjax.errors import CorruptCheckpointError
from checkpoints.lazy_tensors import Index, Lazy, region_shape
from checkpoints.safetensors_reader import TensorEntry

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
