"""agentjax/runner/page_mover.py: a laid-out runner's per-device buffers `[devices, slots, pages, ...]`
move a page as every device's part of it: gathered into each device's host memory, stored in the host
pool and loaded back, or written out as one payload and scattered back, bit for bit on every device."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentjax.kv.cache_layout import KVBufferSpec
from agentjax.runner.page_mover import ShardedBufferPageMover
from tests.sharding.parity import need_devices

DEVICES, SLOTS, PAGES, PAGE_SHAPE = 4, 2, 10, (3, 5)


def _mover_and_buffer():
    need_devices(DEVICES)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("device",))
    on_devices = NamedSharding(mesh, PartitionSpec("device"))
    spec = KVBufferSpec(0, "full_attention", SLOTS, PAGE_SHAPE, "float32")
    mover = ShardedBufferPageMover([spec], DEVICES, on_devices.with_memory_kind("device"),
                                   on_devices.with_memory_kind("pinned_host"),
                                   NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"))
    values = np.random.default_rng(0).standard_normal((DEVICES, SLOTS, PAGES, *PAGE_SHAPE)).astype(np.float32)
    return mover, (jax.device_put(values, on_devices),), values


def test_pages_round_trip_through_the_host_pool_on_every_device():
    mover, kv, original = _mover_and_buffer()
    assert mover.page_bytes(0) == DEVICES * SLOTS * 15 * 4  # every device's part of the page
    pool = mover.new_host_pool(0, 6)
    assert pool.sharding.memory_kind == "pinned_host" and pool.shape == (DEVICES, SLOTS, 6, *PAGE_SHAPE)
    gathered = mover.gather(kv, 0, np.array([3, 7], np.int32))
    pool = mover.host_put(pool, gathered, np.array([4, 1], np.int32))
    kv = mover.host_load(kv, 0, pool, np.array([1, 4], np.int32), np.array([2, 9], np.int32))
    after = np.asarray(kv[0])
    np.testing.assert_array_equal(after[:, :, 2], original[:, :, 7])
    np.testing.assert_array_equal(after[:, :, 9], original[:, :, 3])
    untouched = [p for p in range(PAGES) if p not in (2, 9)]
    np.testing.assert_array_equal(after[:, :, untouched], original[:, :, untouched])


def test_a_payload_written_out_scatters_back_byte_for_byte():
    mover, kv, original = _mover_and_buffer()
    gathered = np.asarray(mover.gather(kv, 0, np.array([5, 6], np.int32)))
    payloads = [mover.payload(gathered, row).tobytes() for row in range(2)]
    assert [len(p) for p in payloads] == [mover.page_bytes(0)] * 2
    values = mover.empty_values(0, 2)
    for row, payload in enumerate(reversed(payloads)):
        mover.put_payload(values, row, 0, payload)
    kv = mover.scatter(kv, 0, mover.to_device(values), np.array([0, 1], np.int32))
    after = np.asarray(kv[0])
    np.testing.assert_array_equal(after[:, :, 0], original[:, :, 6])
    np.testing.assert_array_equal(after[:, :, 1], original[:, :, 5])
    np.testing.assert_array_equal(after[:, :, 2:], original[:, :, 2:])
