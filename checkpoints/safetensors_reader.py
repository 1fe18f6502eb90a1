"""Reads safetensors files on the host, checking each header against the file before any data is used.

`read_header` parses and validates one file's header (length, JSON, dtypes, shapes, offsets inside
the file), so a truncated or corrupt file fails with `CorruptCheckpointError` naming the file and
the tensor, never a raw library traceback. `read_tensor` maps one tensor's bytes read-only.
Host only: never imports jax, never places anything on a device.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentjax.errors import CorruptCheckpointError, UnsupportedModelError

# Header sizes above this are not a real checkpoint (the format itself caps headers at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def _numpy_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes

    return {
        "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
        "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
        "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
        "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
        "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    }


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and byte offset from the start of the file."""

    name: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _corrupt(path: Path, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"safetensors file {path} is truncated or corrupt: {problem}")


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of one file by name, after checking that the header describes this file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise _corrupt(path, f"its header claims {header_len} bytes but the file has {size} bytes")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"its header is a JSON {type(header).__name__}, expected an object")
    dtypes = _numpy_dtypes()
    data_start, data_size = 8 + header_len, size - 8 - header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise _corrupt(path, f"tensor {name!r} lacks dtype, shape or data_offsets in the header")
        if info["dtype"] not in dtypes:
            raise UnsupportedModelError(
                f"tensor {name!r} in {path} has dtype {info['dtype']!r}; supported: {', '.join(dtypes)}"
            )
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise _corrupt(path, f"tensor {name!r} has shape {shape!r}, expected a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise _corrupt(path, f"tensor {name!r} has data_offsets {offsets!r}, expected [begin, end]")
        entry = TensorEntry(name, path, dtypes[info["dtype"]], tuple(shape), data_start + offsets[0])
        begin, end = offsets
        if end - begin != entry.nbytes or begin < 0:
            raise _corrupt(path, f"tensor {name!r} of shape {tuple(shape)} {info['dtype']} needs {entry.nbytes} "
                                 f"bytes but its data_offsets {offsets} span {end - begin}")
        if end > data_size:
            raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data section, "
                                 f"which has only {data_size} bytes")
        entries[name] = entry
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor's values as a read-only array mapped from its file (no copy until converted)."""
    if entry.nbytes == 0:
        return np.zeros(entry.shape, entry.dtype)
    try:
        return np.memmap(entry.file, dtype=entry.dtype, mode="r", offset=entry.offset, shape=entry.shape)
    except (OSError, ValueError) as exc:  # the file shrank or vanished after its header was read
        raise _corrupt(entry.file, f"tensor {entry.name!r} cannot be read ({exc})") from None
