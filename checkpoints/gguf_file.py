"""A fast GGUF reader: the metadata and a numpy view of each tensor, over one read-only memory map.

`gguf.GGUFReader` builds a numpy view for every metadata value, which takes about 18 s on
Gemma-3's 262K-token vocabulary (5 to 12 s on SmolLM2's 49K). This reader parses the key-value and
tensor-info sections with `struct` and maps each tensor's bytes as one numpy view, in well under a
second. Tensor views follow `gguf.GGUFReader`'s conventions (elements for F32, F16 and the integer
types, `[rows, row bytes]` of uint8 for block-quantised ones, `shape` in GGUF's order with the
fastest-varying dimension first), so `gguf.quants.dequantize` reads them as it reads its own.
Little-endian GGUF v2 and v3 only: what llama.cpp and the `gguf` package write.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
# Tensor types stored element by element (the rest are blocks of bytes), by their GGML type names.
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # read-only view into the file


def parse_metadata(buffer, keep: Callable[[str], bool] | None = None) -> tuple[dict[str, Any], int, int]:
    """`(metadata, byte offset after the key-value section, tensor count)` of a GGUF file in `buffer`;
    `keep(key)` picks the keys whose values are kept (all by default; the others are skipped, not
    decoded). Arrays come back as lists, scalars as Python numbers. Raises ValueError on a malformed file."""
    magic, version, num_tensors, num_keys = struct.unpack_from("<4sIQQ", buffer, 0)
    if magic != b"GGUF" or not 2 <= version <= 3:
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
    offset = 24

    def read_string() -> str:
        nonlocal offset
        (length,) = struct.unpack_from("<Q", buffer, offset)
        end = offset + 8 + length
        if end > len(buffer):
            raise ValueError(f"a string at byte {offset} runs past the end of the file")
        text = buffer[offset + 8:end].decode("utf-8")
        offset = end
        return text

    def read_value(value_type: int) -> Any:
        nonlocal offset
        if value_type == _STRING:
            return read_string()
        if value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", buffer, offset)
            offset += 12
            if element_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[element_type])
                values = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).tolist()
                offset += dtype.itemsize * count
                return values
            return [read_value(element_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {offset}")
        (value,) = struct.unpack_from(_SCALAR_FORMATS[value_type], buffer, offset)
        offset += struct.calcsize(_SCALAR_FORMATS[value_type])
        return value

    metadata: dict[str, Any] = {}
    for _ in range(num_keys):
        key = read_string()
        (value_type,) = struct.unpack_from("<I", buffer, offset)
        offset += 4
        value = read_value(value_type)
        if keep is None or keep(key):
            metadata[key] = value
    return metadata, offset, num_tensors


class GGUFFile:
    """One GGUF file: `metadata` (every key) and `tensors` (in the file's order), read on construction.
    The tensor views keep the file mapped while any of them lives. Raises ValueError (or OSError) when
    the file is malformed (or unreadable)."""

    def __init__(self, path: str | os.PathLike):
        import gguf

        with open(path, "rb") as file:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, offset, num_tensors = parse_metadata(buffer)
            infos = []
            for _ in range(num_tensors):
                (length,) = struct.unpack_from("<Q", buffer, offset)
                name = buffer[offset + 8:offset + 8 + length].decode("utf-8")
                offset += 8 + length
                (num_dims,) = struct.unpack_from("<I", buffer, offset)
                shape = struct.unpack_from(f"<{num_dims}Q", buffer, offset + 4)
                offset += 4 + 8 * num_dims
                raw_type, data_offset = struct.unpack_from("<IQ", buffer, offset)
                offset += 12
                infos.append((name, shape, gguf.GGMLQuantizationType(raw_type), data_offset))
        except struct.error as error:
            raise ValueError(f"the file ends inside its header: {error}") from error
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"general.alignment is {self.alignment}, not a power of two")
        self.data_offset = -(-offset // self.alignment) * self.alignment
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, shape, tensor_type, data_offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(GGUFTensor(name, tensor_type, tuple(int(d) for d in shape),
                                           self._view(buffer, name, shape, tensor_type, data_offset)))

    def _view(self, buffer, name: str, shape: tuple[int, ...], tensor_type, data_offset: int) -> np.ndarray:
        import gguf

        rows = tuple(int(d) for d in reversed(shape))  # numpy's order
        elements = int(np.prod(rows, dtype=np.int64))
        dtype = _ELEMENT_DTYPES.get(tensor_type.name)
        if dtype is not None:
            count, view_shape = elements, rows
        else:
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
            if rows[-1] % block_size:
                raise ValueError(f"tensor {name!r}: a row of {rows[-1]} is not whole blocks of {block_size}")
            dtype, count = np.uint8, elements // block_size * block_bytes
            view_shape = (*rows[:-1], rows[-1] // block_size * block_bytes)
        start = self.data_offset + data_offset
        if start + count * np.dtype(dtype).itemsize > len(buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(view_shape)
