"""Checksums of converted parameter arrays, recorded when a cache entry is written and verified on read.

A manifest maps each array name to its dtype, shape and CRC-32 (zlib's, several GB/s, enough to
catch torn or bit-flipped cache files; not a defence against tampering). `verify_arrays` raises
`CorruptCheckpointError` naming every array that fails. Host only: numpy and zlib, never jax.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from agentjax.errors import CorruptCheckpointError

MANIFEST_FORMAT = 1
NAMES_SHOWN = 8


def bytes_checksum(data: bytes | memoryview | np.ndarray) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def array_checksum(array: np.ndarray) -> int:
    """CRC-32 of the array's bytes in C order (dtype and shape are recorded beside it)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return bytes_checksum(flat.view(np.uint8))


def array_record(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "crc32": array_checksum(array)}


def manifest(arrays: Mapping[str, np.ndarray], config_text: str) -> dict[str, Any]:
    """What a cache entry records at conversion: every array's record and the config's checksum."""
    return {
        "format": MANIFEST_FORMAT,
        "config_crc32": bytes_checksum(config_text.encode()),
        "arrays": {name: array_record(np.asarray(array)) for name, array in arrays.items()},
    }


def verify_config(recorded: Mapping[str, Any], config_text: str, where: str) -> None:
    if recorded.get("config_crc32") != bytes_checksum(config_text.encode()):
        raise CorruptCheckpointError(f"{where}: config.json does not match its recorded checksum")


def verify_arrays(recorded: Mapping[str, Any], arrays: Mapping[str, np.ndarray], where: str) -> None:
    """Raise `CorruptCheckpointError` unless every array matches its record (and no record lacks one)."""
    if recorded.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpointError(
            f"{where}: checksum manifest has format {recorded.get('format')!r}, expected {MANIFEST_FORMAT}"
        )
    records = recorded.get("arrays", {})
    failures = [f"{name} is missing" for name in sorted(set(records) - set(arrays))]
    failures += [f"{name} has no recorded checksum" for name in sorted(set(arrays) - set(records))]
    for name in sorted(set(records) & set(arrays)):
        array, record = np.asarray(arrays[name]), records[name]
        if str(array.dtype) != record["dtype"] or list(array.shape) != record["shape"]:
            failures.append(f"{name} is {array.dtype}{list(array.shape)}, recorded {record['dtype']}{record['shape']}")
        elif array_checksum(array) != record["crc32"]:
            failures.append(f"{name} has CRC-32 {array_checksum(array):08x}, recorded {record['crc32']:08x}")
    if failures:
        more = f" (and {len(failures) - NAMES_SHOWN} more)" if len(failures) > NAMES_SHOWN else ""
        raise CorruptCheckpointError(
            f"{where}: {len(failures)} arrays fail verification: {'; '.join(failures[:NAMES_SHOWN])}{more}"
        )
