"""The offload worker over a KV pool (agentjax/runner/page_mover.py, agentjax/kv_buffers.py): a page of every
page group (packed prefix kinds, windows, states) goes from the pool to the host pool, the disk and back
byte for byte into other pages of its group, and nothing else in the pool changes."""
from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from agentjax.kv import KVCacheManager
from agentjax.kv.layout import build_layout
from agentjax.kv.offload.connector import KVTransfers, LoadJob, OffloadConnector, PageTransfer, StoreJob
from agentjax.kv.offload.disk import DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv_buffers import KVPool, gather_group_pages, new_pool
from agentjax.models.presets import PRESETS
from agentjax.runner.offload_worker import OffloadWorker


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
