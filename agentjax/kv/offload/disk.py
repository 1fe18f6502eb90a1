"""The disk tier: one file per KV page under `--disk-cache-dir`, each with a header and a CRC-32.

A page file is written to a temporary name and renamed into place, so a reader never sees half a
page; the index (key -> bytes, least recently used first) is rebuilt from the directory at start,
and the tier evicts files to stay under its size cap: the oldest, or with `scored=True` the one of
lowest GreedyDual priority (recompute FLOPs per byte, `TierEntryScore`, plus recency; files found
at start score 0, so they go first). A page whose length, header or
checksum disagrees is deleted and reported corrupt (the engine then recomputes it). Never
unpickles, never imports jax; safe to call from the offload worker's thread and the scheduler.
"""
from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from pathlib import Path

from agentjax.errors import CorruptCheckpointError, OffloadTierError
from agentjax.kv.offload.policies import GreedyDualOrder
from agentjax.progress import Throttle

logger = logging.getLogger(__name__)

TierKey = tuple[int, bytes]  # (KV group id, the page's chained block hash)
MAGIC = b"AJKV"
VERSION = 1
# magic, version, group, CRC-32 of the payload, payload bytes, block hash (32 bytes)
HEADER = struct.Struct("<4sHHIQ32s")
SUFFIX = ".kvp"


class DiskFullError(OSError):
    """The file system has no room for a page (ENOSPC or EDQUOT)."""


class DiskTier:
    """Page files under `root/namespace/g<group>/<hash hex>.kvp`, capped at `capacity_bytes`."""

    def __init__(self, root: str | os.PathLike, namespace: str, capacity_bytes: int, scored: bool = False):
        if capacity_bytes <= 0:
            raise OffloadTierError(f"the disk tier's size cap must be > 0 bytes, got {capacity_bytes}")
        self.directory = Path(root) / namespace
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[TierKey, int] = OrderedDict()  # key -> file bytes, oldest first
        self._order = GreedyDualOrder() if scored else None  # else the index's own order (LRU)
        self.used_bytes = 0
        self.evictions = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"agentjax")
            probe.unlink()
        except OSError as error:
            raise OffloadTierError(f"disk_cache_dir {str(root)!r} is not a writable directory: {error}") from error
        self._rebuild_index()

    # -- index -----------------------------------------------------------------------------------
    def _path(self, key: TierKey) -> Path:
        group, block_hash = key
        return self.directory / f"g{group}" / f"{block_hash.hex()}{SUFFIX}"

    def _rebuild_index(self) -> None:
        """Index the page files already on disk, oldest modification first; drop temporary files."""
        found = []
        throttle = Throttle()
        for group_dir in self.directory.glob("g*"):
            if not group_dir.is_dir() or not group_dir.name[1:].isdigit():
                continue
            group = int(group_dir.name[1:])
            for entry in os.scandir(group_dir):
                if entry.name.startswith(".tmp-"):
                    _unlink_quietly(Path(entry.path))
                    continue
                stem = entry.name[: -len(SUFFIX)]
                if not entry.name.endswith(SUFFIX) or len(stem) != 64:
                    continue
                try:
                    block_hash = bytes.fromhex(stem)
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime_ns, (group, block_hash), stat.st_size))
                if throttle.due():
                    logger.info("disk KV tier: recovering the page files under %s: %d found so far (%.0f s)",
                                self.directory, len(found), throttle.elapsed)
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self.used_bytes += size
            if self._order is not None:
                self._order.add(key, 0.0)
        self._evict_to(self.capacity_bytes)
        if found:
            logger.info("disk KV tier: recovered %d page files (%.1f MB) under %s in %.1f s", len(self._index),
                        self.used_bytes / 2**20, self.directory, throttle.elapsed)

    def contains(self, key: TierKey) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[TierKey]:
        with self._lock:
            return list(self._index)

    def _evict_to(self, limit: int) -> None:
        while self._index and self.used_bytes > limit:
            if self._order is None:
                key, size = self._index.popitem(last=False)
            else:
                key = self._order.pop()
                size = self._index.pop(key)
            self.used_bytes -= size
            self.evictions += 1
            self._delete_file(key)

    def _delete_file(self, key: TierKey) -> None:
        _unlink_quietly(self._path(key))

    def drop(self, key: TierKey) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size
            if self._order is not None:
                self._order.remove(key)
        self._delete_file(key)

    def record(self, key: TierKey, size: int, score: float = 0.0) -> None:
        """Index a page whose file is written (`size` bytes), then evict down to the size cap."""
        with self._lock:
            old = self._index.pop(key, None)
            self.used_bytes += size - (old or 0)
            self._index[key] = size
            if self._order is not None:
                self._order.add(key, score)
            self._evict_to(self.capacity_bytes)

    def touch(self, key: TierKey) -> None:
        """A page was read: the most recently used."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                if self._order is not None:
                    self._order.touch(key)

    # -- pages -----------------------------------------------------------------------------------
    def write(self, key: TierKey, payload: bytes | memoryview, score: float = 0.0) -> None:
        """Store one page (temporary file, then rename); `score` is its `TierEntryScore` (used with
        `scored`). Raises `DiskFullError` when the file system is full, `OSError` on other failures;
        the tier is unchanged then."""
        group, block_hash = key
        header = HEADER.pack(MAGIC, VERSION, group, zlib.crc32(payload), len(payload), block_hash)
        size = HEADER.size + len(payload)
        if size > self.capacity_bytes:
            raise OffloadTierError(f"a {size}-byte page exceeds the disk tier's cap of {self.capacity_bytes} bytes")
        path = self._path(key)
        temporary = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, path)
        except OSError as error:
            _unlink_quietly(temporary)
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(error.errno, f"no space for a KV page under {self.directory}") from error
            raise
        self.record(key, size, score)

    def read(self, key: TierKey, expected_bytes: int) -> memoryview:
        """The page's payload. Raises KeyError if the tier does not hold it, `CorruptCheckpointError`
        (after deleting the file) if its length, header or checksum is wrong."""
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            self.drop(key)
            raise KeyError(key) from None
        problem = self._check(key, data, expected_bytes)
        if problem is not None:
            self.drop(key)
            raise CorruptCheckpointError(f"disk KV page {path.name} of group {key[0]}: {problem}; deleted")
        self.touch(key)
        return memoryview(data)[HEADER.size:]

    @staticmethod
    def _check(key: TierKey, data: bytes, expected_bytes: int) -> str | None:
        if len(data) < HEADER.size:
            return f"truncated to {len(data)} bytes, shorter than its {HEADER.size}-byte header"
        magic, version, group, checksum, length, block_hash = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            return f"bad magic {magic!r} or version {version} (expected {MAGIC!r} v{VERSION})"
        if (group, block_hash) != key:
            return "its header names another page"
        if length != expected_bytes:
            return f"holds {length} payload bytes, expected {expected_bytes}"
        if len(data) != HEADER.size + length:
            return f"truncated: {len(data) - HEADER.size} of {length} payload bytes"
        if zlib.crc32(memoryview(data)[HEADER.size:]) != checksum:
            return "CRC-32 mismatch"
        return None


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
