"""The disk tier: page files with a CRC-32, written atomically, indexed again at start, capped in size;
corrupt, truncated and foreign pages are refused and deleted; a full file system raises DiskFullError."""
from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from agentjax.errors import CorruptCheckpointError, OffloadTierError
from agentjax.kv.offload.disk import HEADER, DiskFullError, DiskTier

PAGE = 4096


def _key(i: int, group: int = 0) -> tuple[int, bytes]:
    return group, hashlib.sha256(str(i).encode()).digest()


def _payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAGE))


def test_pages_read_back_byte_for_byte_and_survive_a_restart(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    for i in range(5):
        tier.write(_key(i, group=i % 2), _payload(i))
    assert bytes(tier.read(_key(3, 1), PAGE)) == _payload(3)
    restarted = DiskTier(tmp_path, "ns", 1 << 20)
    assert len(restarted) == 5 and restarted.contains(_key(4, 0)) and not restarted.contains(_key(4, 1))
    assert bytes(restarted.read(_key(4, 0), PAGE)) == _payload(4)
    assert restarted.used_bytes == 5 * (HEADER.size + PAGE)


def test_another_namespace_sees_none_of_the_pages(tmp_path):
    DiskTier(tmp_path, "model-a", 1 << 20).write(_key(1), _payload(1))
    assert not DiskTier(tmp_path, "model-b", 1 << 20).contains(_key(1))


def test_the_size_cap_evicts_the_least_recently_used_page_files(tmp_path):
    tier = DiskTier(tmp_path, "ns", 3 * (HEADER.size + PAGE))
    for i in range(3):
        tier.write(_key(i), _payload(i))
    tier.read(_key(0), PAGE)  # page 0 becomes the most recently used
    tier.write(_key(3), _payload(3))
    assert [tier.contains(_key(i)) for i in range(4)] == [True, False, True, True]
    assert tier.evictions == 1 and len(list((tmp_path / "ns" / "g0").iterdir())) == 3


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "wrong length"])
def test_a_damaged_page_is_refused_and_deleted(tmp_path, damage):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    tier.write(_key(7), _payload(7))
    path = tier._path(_key(7))
    data = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        data[HEADER.size + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: HEADER.size + PAGE // 2]))
    with pytest.raises(CorruptCheckpointError):
        tier.read(_key(7), PAGE if damage != "wrong length" else PAGE * 2)
    assert not path.exists() and not tier.contains(_key(7))


def test_a_missing_file_is_a_miss_not_an_error(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    tier.write(_key(1), _payload(1))
    tier._path(_key(1)).unlink()
    with pytest.raises(KeyError):
        tier.read(_key(1), PAGE)
    assert not tier.contains(_key(1))


def test_leftover_temporary_files_are_removed_at_start(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    tier.write(_key(1), _payload(1))
    leftover = tmp_path / "ns" / "g0" / ".tmp-crashed-writer"
    leftover.write_bytes(b"half a page")
    restarted = DiskTier(tmp_path, "ns", 1 << 20)
    assert not leftover.exists() and len(restarted) == 1


def test_a_directory_that_cannot_be_written_is_a_start_up_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(OffloadTierError, match="not a writable directory"):
        DiskTier(blocker, "ns", 1 << 20)


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A real 256 KiB tmpfs (needs mount rights, as root in CI has)."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_file_system_raises_disk_full_and_leaves_no_partial_file(tiny_filesystem):
    tier = DiskTier(tiny_filesystem, "ns", 1 << 30)
    written = 0
    with pytest.raises(DiskFullError):
        for i in range(200):
            tier.write(_key(i), _payload(i))
            written += 1
    assert 0 < written < 200 and len(tier) == written
    assert not [name for name in os.listdir(tiny_filesystem / "ns" / "g0") if name.startswith(".tmp-")]
    assert bytes(tier.read(_key(0), PAGE)) == _payload(0)  # what was written still reads back
