"""The offload worker (agentjax/runner/offload_worker.py): pages of every KV kind (Kimi-K3's MLA latents and
recurrent states, MiniMax-M3's attention pages and indexer keys) go from the device buffers to the
host pool, the disk and back byte for byte; a corrupt disk page is reported failed and its
destination left alone."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from agentjax.kv import KVCacheManager
from agentjax.kv.offload.connector import KVTransfers, LoadJob, OffloadConnector, PageTransfer, StoreJob
from agentjax.kv.offload.disk import HEADER, DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.models.presets import PRESETS
from agentjax.runner.offload_worker import OffloadWorker

NUM_PAGES = 12


@pytest.fixture(params=[("tiny-kimi-k3", 16), ("tiny-minimax-m3", 128)], ids=["kimi-latent-state", "minimax-kv-index"])
def setup(tmp_path, request):
    preset, page_size = request.param
    cfg = PRESETS[preset]
    kv = KVCacheManager.from_model_config(cfg, NUM_PAGES, page_size)
    connector = OffloadConnector(kv, host=HostPageIndex(len(kv.groups), 8), disk=DiskTier(tmp_path, "ns", 1 << 30))
    worker = OffloadWorker(cfg, page_size, connector, host_slots=8)
    rng = np.random.default_rng(0)
    buffers = tuple(jax.numpy.asarray(rng.standard_normal(b.shape).astype(b.dtype))
                    for b in cfg.new_kv_pages(NUM_PAGES, page_size))
    runner = SimpleNamespace(kv_pages=buffers)
    yield runner, connector, worker
    worker.close()


def _finish(runner, connector, worker, job_id: int, timeout_s: float = 30.0) -> set:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.run(runner, None)
        for item in connector.results.drain():
            if item[0] == "load" and item[1] == job_id:
                return item[2]
        worker.wait(0.05)
    raise AssertionError("the load never completed")


def test_every_kv_kind_round_trips_through_the_host_pool_and_the_disk(setup):
    runner, connector, worker = setup
    assert {spec.kind for spec in worker.specs} in ({"recurrent_state", "mla_latent"},
                                                    {"full_attention", "indexer_keys"})
    original = [np.asarray(b) for b in runner.kv_pages]
    keys = {(g, p): bytes([g, p]) * 16 for g in range(len(original)) for p in (3, 5)}
    stores = [StoreJob(1 + g, g, [keys[(g, 3)], keys[(g, 5)]], [3, 5], host_slots=[1, 2], disk_rows=[0, 1])
              for g in range(len(original))]
    worker.run(runner, KVTransfers(stores=stores))
    deadline = time.monotonic() + 30
    while len(connector.disk) < 2 * len(original) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(connector.disk.keys()) == 2 * len(original)
    loads = [PageTransfer(g, keys[(g, src)], dst, tier, slot=(src == 5) + 1 if tier == "host" else 0)
             for g in range(len(original)) for src, dst, tier in ((3, 7, "host"), (5, 8, "host"),
                                                                   (3, 9, "disk"), (5, 10, "disk"))]
    worker.run(runner, KVTransfers(loads=[LoadJob(2, "r", loads)]))
    assert _finish(runner, connector, worker, 2) == {}
    for group, before in enumerate(original):
        after = np.asarray(runner.kv_pages[group])
        for src, dst in ((3, 7), (5, 8), (3, 9), (5, 10)):
            assert np.array_equal(after[:, dst], before[:, src]), (group, src, dst)
        untouched = [p for p in range(NUM_PAGES) if p not in (7, 8, 9, 10)]
        assert np.array_equal(after[:, untouched], before[:, untouched])
    assert connector.stats.get("pages_stored", "host") == 2 * len(original)
    assert connector.stats.get("pages_stored", "disk") == 2 * len(original)


def test_a_corrupt_disk_page_fails_its_load_and_leaves_the_destination_alone(setup):
    runner, connector, worker = setup
    key = b"\x07" * 32
    worker.run(runner, KVTransfers(stores=[StoreJob(1, 0, [key], [4], host_slots=[0], disk_rows=[0])]))
    deadline = time.monotonic() + 30
    while not connector.disk.contains((0, key)) and time.monotonic() < deadline:
        time.sleep(0.05)
    path = connector.disk._path((0, key))
    data = bytearray(path.read_bytes())
    data[HEADER.size + 5] ^= 1
    path.write_bytes(bytes(data))
    before = np.asarray(runner.kv_pages[0])
    worker.run(runner, KVTransfers(loads=[LoadJob(3, "r", [PageTransfer(0, key, 6, "disk")])]))
    assert set(_finish(runner, connector, worker, 3)) == {(0, key)}
    assert np.array_equal(np.asarray(runner.kv_pages[0]), before)
    assert connector.stats.get("load_failures", "disk", reason="checksum") == 1


def test_a_load_stuck_past_its_deadline_is_given_up_and_what_it_fetches_later_is_never_written(tmp_path):
    cfg, page_size = PRESETS["tiny-dense"], 16
    kv = KVCacheManager.from_model_config(cfg, NUM_PAGES, page_size)
    connector = OffloadConnector(kv, disk=DiskTier(tmp_path, "ns", 1 << 30))
    worker = OffloadWorker(cfg, page_size, connector, load_timeout_s=0.3)
    runner = SimpleNamespace(kv_pages=tuple(jax.numpy.asarray(np.random.default_rng(1).standard_normal(b.shape)
                                                              .astype(b.dtype))
                                            for b in cfg.new_kv_pages(NUM_PAGES, page_size)))
    key = b"\x09" * 32
    worker.run(runner, KVTransfers(stores=[StoreJob(1, 0, [key], [4], host_slots=[0], disk_rows=[0])]))
    worker.flush(runner)
    path = connector.disk._path((0, key))
    page_file = path.read_bytes()
    path.unlink()
    os.mkfifo(path)  # a read of it blocks until a writer comes: a hung disk
    before = np.asarray(runner.kv_pages[0])
    started = time.monotonic()
    worker.run(runner, KVTransfers(loads=[LoadJob(2, "r", [PageTransfer(0, key, 6, "disk")])]))
    failed = _finish(runner, connector, worker, 2)
    assert 0.3 <= time.monotonic() - started < 5
    assert list(failed) == [(0, key)] and failed[(0, key)][0] == "timeout"
    assert connector.health["disk"].degraded and connector.stats.get("load_failures", "disk", reason="timeout") == 1
    with open(path, "wb") as fifo:  # the disk answers at last, with the right page
        fifo.write(page_file)
    deadline = time.monotonic() + 30
    while len(worker.loads) and time.monotonic() < deadline:
        worker.run(runner, None)
        time.sleep(0.02)
    assert len(worker.loads) == 0  # the late part reported, and was dropped
    assert np.array_equal(np.asarray(runner.kv_pages[0]), before)  # page 6 may be another request's by now
    worker.close()
