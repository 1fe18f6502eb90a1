"""agentjax/runner/page_mover.py over both forms of KV memory. The offload worker over a KV pool
(agentjax/kv_buffers.py): a page of every page group (packed prefix kinds, windows, states) goes from the
pool to the host pool, the disk and back byte for byte into other pages of its group, and nothing else in
the pool changes. A laid-out runner's per-device buffers `[devices, slots, pages, ...]` or pool `[devices,
slabs, slab words]` move a page as every device's part of it: gathered into each device's host memory,
stored in the host pool and loaded back, or written out as one payload and scattered back, bit for bit on
every device."""
from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentjax.kv import KVCacheManager
from agentjax.kv.cache_layout import KVBufferSpec
from agentjax.kv.layout_build import build_layout
from agentjax.kv.offload.connector import KVTransfers, LoadJob, OffloadConnector, PageTransfer, StoreJob
from agentjax.kv.offload.disk import DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv_buffers import DeviceLayout, KVPool, gather_group_pages, new_pool
from agentjax.models.presets import PRESETS
from agentjax.runner.offload_worker import OffloadWorker
from agentjax.runner.page_mover import ShardedBufferPageMover, ShardedPoolPageMover
from tests.sharding.parity import need_devices


@pytest.fixture(params=["tiny-kimi-k3", "tiny-dsv4"])
def setup(tmp_path, request):
    cfg = PRESETS[request.param]
    layout = build_layout(cfg, 16, memory_bytes=1 << 20)
    kv = KVCacheManager.from_layout(layout)
    connector = OffloadConnector(kv, host=HostPageIndex(len(kv.groups), 8), disk=DiskTier(tmp_path, "ns", 1 << 30))
    worker = OffloadWorker(cfg, 16, connector, host_slots=8, kv_layout=layout)
    pool = new_pool(layout)
    rng = np.random.default_rng(0)
    pool = KVPool(jax.numpy.asarray(rng.standard_normal(pool.array.shape).astype(pool.array.dtype)), pool.layout)
    pages = [kv.pool.allocate(6, group=g).tolist() for g in range(len(layout.groups))]  # pages the groups own
    yield SimpleNamespace(kv_pages=pool), connector, worker, pages
    worker.close()


def _finish(runner, connector, worker, job_id: int, timeout_s: float = 60.0) -> set:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.run(runner, None)
        for item in connector.results.drain():
            if item[0] == "load" and item[1] == job_id:
                return item[2]
        worker.wait(0.05)
    raise AssertionError("the load never completed")


def test_every_page_group_round_trips_through_the_host_pool_and_the_disk(setup):
    runner, connector, worker, pages = setup
    groups = range(len(pages))
    before = np.asarray(runner.kv_pages.array)
    rows_before = {g: np.asarray(gather_group_pages(runner.kv_pages, g, np.asarray(pages[g]))) for g in groups}
    keys = {(g, i): bytes([g, i]) * 16 for g in groups for i in (0, 1)}
    stores = [StoreJob(1 + g, g, [keys[(g, 0)], keys[(g, 1)]], pages[g][:2], host_slots=[1, 2], disk_rows=[0, 1])
              for g in groups]
    worker.run(runner, KVTransfers(stores=stores))
    deadline = time.monotonic() + 60
    while len(connector.disk) < 2 * len(pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(connector.disk.keys()) == 2 * len(pages)
    loads = [PageTransfer(g, keys[(g, src)], pages[g][dst], tier, slot=src + 1 if tier == "host" else 0)
             for g in groups for src, dst, tier in ((0, 2, "host"), (1, 3, "host"), (0, 4, "disk"), (1, 5, "disk"))]
    worker.run(runner, KVTransfers(loads=[LoadJob(99, "r", loads)]))
    assert _finish(runner, connector, worker, 99) == {}  # no page failed
    changed = np.zeros(before.size, dtype=bool)
    for g in groups:
        after = np.asarray(gather_group_pages(runner.kv_pages, g, np.asarray(pages[g])))
        for src, dst in ((0, 2), (1, 3), (0, 4), (1, 5)):
            assert np.array_equal(after[dst], rows_before[g][src]), (g, src, dst)
        assert np.array_equal(after[:2], rows_before[g][:2])
        changed |= np.asarray(runner.kv_pages.array).reshape(-1) != before.reshape(-1)
    # only the destination pages' cells changed: as many words as 4 pages of every group hold
    assert changed.sum() <= sum(4 * g.page_words for g in worker.mover.layout.groups)


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


def _pool_mover_and_pool():
    """A pool `[devices, slabs, slab words]` of tiny-kimi-k3's layout (latents, windows and recurrent
    states in page groups), each device's part random and different."""
    need_devices(DEVICES)
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("device",))
    on_devices = NamedSharding(mesh, PartitionSpec("device"))
    layout = build_layout(PRESETS["tiny-kimi-k3"], 16, memory_bytes=1 << 20)
    mover = ShardedPoolPageMover(layout, DEVICES, on_devices.with_memory_kind("device"),
                                 on_devices.with_memory_kind("pinned_host"),
                                 NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host"))
    shape = (DEVICES, layout.num_slabs, layout.slab_words)
    values = np.random.default_rng(1).standard_normal(shape).astype(jax.numpy.dtype(layout.dtype))
    pool = KVPool(jax.device_put(values, on_devices), DeviceLayout.of(layout))
    pages = [KVCacheManager.from_layout(layout).pool.allocate(4, group=g) for g in range(len(layout.groups))]
    return mover, pool, values, pages


def _device_rows(pool: KVPool, group: int, pages) -> np.ndarray:
    """`[devices, pages, page words]`: each device's flat row of each page of `group`, read one device at a time."""
    array = np.asarray(pool.array)
    return np.stack([np.asarray(gather_group_pages(KVPool(jax.numpy.asarray(array[d]), pool.layout), group,
                                                   np.asarray(pages))) for d in range(array.shape[0])])


def test_pool_pages_of_every_group_round_trip_through_the_host_pool_on_every_device():
    mover, pool, original, pages = _pool_mover_and_pool()
    layout = mover.layout
    for group in range(mover.num_groups):
        assert mover.page_bytes(group) == DEVICES * layout.page_bytes(group)  # every device's part of the page
        before = _device_rows(pool, group, pages[group])
        assert not np.array_equal(before[0], before[1])  # the devices' parts differ, so a mix-up would show
        host = mover.new_host_pool(group, 6)
        assert host.sharding.memory_kind == "pinned_host"
        assert host.shape == (DEVICES, 6, layout.groups[group].page_words)
        gathered = mover.gather(pool, group, np.asarray(pages[group][:2], np.int32))
        np.testing.assert_array_equal(np.asarray(gathered), before[:, :2])
        host = mover.host_put(host, gathered, np.array([4, 1], np.int32))
        pool = mover.host_load(pool, group, host, np.array([1, 4], np.int32), np.asarray(pages[group][2:], np.int32))
        after = _device_rows(pool, group, pages[group])
        np.testing.assert_array_equal(after[:, 2], before[:, 1])
        np.testing.assert_array_equal(after[:, 3], before[:, 0])
        np.testing.assert_array_equal(after[:, :2], before[:, :2])
    changed = (np.asarray(pool.array) != original).reshape(DEVICES, -1).sum(axis=1)
    # on each device only the destination pages' cells changed: at most 2 pages of every group
    assert (changed <= sum(2 * g.page_words for g in layout.groups)).all() and changed.min() > 0


def test_a_pool_payload_written_out_scatters_back_byte_for_byte_on_every_device():
    mover, pool, original, pages = _pool_mover_and_pool()
    for group in range(mover.num_groups):
        before = _device_rows(pool, group, pages[group])
        gathered = np.asarray(mover.gather(pool, group, np.asarray(pages[group][:2], np.int32)))
        payloads = [mover.payload(gathered, row).tobytes() for row in range(2)]
        assert [len(p) for p in payloads] == [mover.page_bytes(group)] * 2
        values = mover.empty_values(group, 2)
        for row, payload in enumerate(reversed(payloads)):
            mover.put_payload(values, row, group, payload)
        pool = mover.scatter(pool, group, mover.to_device(values), np.asarray(pages[group][2:], np.int32))
        after = _device_rows(pool, group, pages[group])
        np.testing.assert_array_equal(after[:, 2], before[:, 1])
        np.testing.assert_array_equal(after[:, 3], before[:, 0])
        np.testing.assert_array_equal(after[:, :2], before[:, :2])
