"""The worker side of the KV offload connector: it moves pages between the runner's device buffers and
the tiers, and reports completions to the scheduler side (`agentjax.kv.offload.connector`).

At each step, before the runner's copies and forward, `run` dispatches the step's `KVTransfers`:
stores gather their pages (one jitted gather per group into `pinned_host` memory) and put them into
the host pool (one `pinned_host` array per group) or hand them to a tier thread (disk, Mooncake);
loads scatter host-pool pages back at once and fetch disk and Mooncake pages in those threads, to
be scattered at a later step. Every dispatch is asynchronous: the host never waits on a copy, and
the device orders each copy before the step that reads or overwrites its pages. A failed fetch
leaves its page out (the request recomputes it) and reports why; a load that waits on a tier silent
for `load_timeout_s` (`InFlightLoads`) is given up and that tier degraded; a failing tier is
degraded, never fatal.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import Callable

import jax
import numpy as np

from agentjax.config import EngineConfig
from agentjax.errors import CorruptCheckpointError, OffloadTierError
from agentjax.kv.cache_layout import kv_buffer_specs
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.transfers import KVTransfers, LoadJob, StoreJob
from agentjax.kv.offload.disk import DiskFullError, DiskTier
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.inflight import InFlightLoads
from agentjax.kv.offload.policies import GroupEntries, RecomputeCost, TierEntryScore
from agentjax.kv.offload.mooncake import MooncakeError, MooncakeTier
from agentjax.kv.offload.tiers import OffloadStats, TierHealth, TIER_NAMES
from agentjax.ragged_batch import bucket
from agentjax.runner.page_mover import page_mover

logger = logging.getLogger(__name__)

TRANSFER_BUCKETS = (4, 16, 64, 256, 1024, 4096, 16384)


def _padded(values: list[int], size: int, fill: int | None = None) -> np.ndarray:
    """`values` padded to `size` with `fill` (default: its last value, so a padded write repeats a real one)."""
    out = np.full(size, values[-1] if fill is None else fill, dtype=np.int32)
    out[: len(values)] = values
    return out


class OffloadWorker:
    """Host page pools, the jitted page movers and one thread per remote tier."""

    def __init__(self, model_cfg, page_size: int, connector: OffloadConnector, host_slots: int = 0,
                 load_timeout_s: float = EngineConfig.kv_load_timeout_s, kv_layout=None, mover=None):
        """`mover` (agentjax/runner/page_mover.py): how pages leave and reach the runner's KV memory; by
        default one device's: its pool with a "pool" `kv_layout` (a `KVMemoryLayout`), else per-kind
        buffers of `page_size`-token pages."""
        self.connector = connector
        self.results = connector.results
        self.stats: OffloadStats = connector.stats
        self.health: dict[str, TierHealth] = connector.health
        self.disk: DiskTier | None = connector.disk
        self.mooncake: MooncakeTier | None = connector.mooncake
        self.mover = mover or page_mover(model_cfg, page_size, kv_layout=kv_layout)
        self.specs = getattr(self.mover, "specs", None)  # per-kind buffers' specs (None for a pool)
        self.host_pools = [self.mover.new_host_pool(group, host_slots) for group in range(self.mover.num_groups)] \
            if host_slots else []
        self._fetched: queue.Queue = queue.Queue()
        self.loads = InFlightLoads(load_timeout_s)  # the parts of each load job still out, and its deadline
        self._queues: dict[str, queue.PriorityQueue] = {}
        self._sequence = 0
        self._threads = []
        for tier, present in (("disk", self.disk), ("mooncake", self.mooncake)):
            if present is not None:
                self._queues[tier] = queue.PriorityQueue()
                thread = threading.Thread(target=self._tier_loop, args=(tier,), name=f"kv-offload-{tier}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, runner, transfers: KVTransfers | None) -> None:
        """Dispatch this step's transfers and scatter what the tier threads fetched since the last step."""
        if transfers:
            for job in transfers.stores:
                self._store(runner, job)
            for request_id, keys in transfers.probes:
                self._submit("mooncake", 0, functools.partial(self._probe, request_id, keys))
            for job in transfers.loads:
                self._load(runner, job)
        while True:
            try:
                job_id, part, values, pages, failed = self._fetched.get_nowait()
            except queue.Empty:
                break
            if self.loads.given_up(job_id):  # past its deadline: its pages may be another request's now
                self.loads.part_done(job_id, part, failed)
                continue
            if len(pages):
                self._scatter_into(runner, part[1], values, pages)
            self._part_done(job_id, part, failed)
        for job_id, failed, late in self.loads.expire():
            for tier, pages in late.items():
                self._timed_out(tier, pages)
            self.results.put(("load", job_id, failed))

    def wait(self, timeout_s: float) -> None:
        """Block until a tier thread reports or the scheduler side has a result (idle engine steps)."""
        if self._fetched.empty():
            self.results.wait(timeout_s)

    def _submit(self, tier: str, priority: int, task) -> None:
        self._sequence += 1
        self._queues[tier].put((priority, self._sequence, task))

    def _tier_loop(self, tier: str) -> None:
        tasks = self._queues[tier]
        while True:
            _, _, task = tasks.get()
            try:
                if task is None:
                    return
                task()
            except Exception:  # a bug in a task must not kill the thread that serves the others
                logger.exception("KV offload %s task failed", tier)
            finally:
                tasks.task_done()

    def flush(self, runner) -> None:
        """Dispatch the stores the scheduler side has prepared and wait until every tier thread is idle
        (tests and benchmarks: the pause between an agent's turns, made explicit). Never on the step path."""
        self.run(runner, self.connector.take_transfers())
        for tasks in self._queues.values():
            tasks.join()

    def after_stores(self, runner, done: Callable[[], None]) -> None:
        """Dispatch the stores the scheduler side has prepared now (between steps), then call `done` once
        every remote tier thread has written them and whatever it had queued before them: from a tier
        thread, or at once without remote tiers. Nothing waits here (a router's P/D prefill and a
        session migration wait on `done`, not the engine)."""
        self.run(runner, self.connector.take_transfers())
        tiers = list(self._queues)
        if not tiers:
            done()
            return
        remaining = [len(tiers)]
        lock = threading.Lock()

        def reached() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                done()

        for tier in tiers:  # stores run at priority 1 in submission order: this marker runs after them
            self._submit(tier, 1, reached)

    # -- stores ----------------------------------------------------------------------------------
    def _store(self, runner, job: StoreJob) -> None:
        """One gather of the job's pages into pinned host memory; the host pool takes its rows at once,
        the disk and Mooncake threads theirs in the background."""
        size = bucket(len(job.pages), TRANSFER_BUCKETS)
        gathered = self.mover.gather(runner.kv_pages, job.group, _padded(job.pages, size, fill=0))
        host_rows = job.tier_rows("host")
        if host_rows:
            slots = _padded(job.host_slots, size, fill=0)  # rows not for the host write slot 0 (never read)
            self.host_pools[job.group] = self.mover.host_put(self.host_pools[job.group], gathered, slots)
            self.stats.add("pages_stored", "host", len(host_rows))
        for tier in ("disk", "mooncake"):
            rows = job.tier_rows(tier)
            if rows:
                targets = [(row, (job.group, job.keys[row]), job.scores[row] if job.scores else 0.0) for row in rows]
                self._submit(tier, 1, functools.partial(self._write_pages, tier, gathered, targets))

    def _write_pages(self, tier: str, gathered, targets: list) -> None:
        values = np.asarray(gathered)  # waits for this gather only, in this thread
        health = self.health[tier]
        stored = []
        for row, key, score in targets:
            if not health.storable():
                self.stats.add("store_skipped", tier, len(targets) - len(stored))
                break
            payload = self.mover.payload(values, row)
            try:
                if tier == "disk":
                    self.disk.write(key, payload, score)
                else:
                    self.mooncake.put(key, payload)
            except DiskFullError as error:
                self.stats.add("store_failures", tier, reason="disk_full")
                health.fail("disk_full", str(error), stores_only=True)
            except MooncakeError as error:
                self.stats.add("store_failures", tier, reason="error")
                health.fail("unreachable", str(error))
                self.results.put(("remote_down", tier))
            except OSError as error:
                self.stats.add("store_failures", tier, reason="io_error")
                logger.warning("KV offload %s store failed: %s", tier, error)
            else:
                stored.append(key)
            finally:
                self.loads.answered(tier)  # a tier busy writing is alive: the loads behind it wait on
        if stored:
            self.stats.add("pages_stored", tier, len(stored))
            self.results.put(("stored", tier, stored))

    # -- probes and loads ------------------------------------------------------------------------
    def _probe(self, request_id: str, keys: list) -> None:
        present = []
        if self.health["mooncake"].usable():
            try:
                present = [key for key, held in zip(keys, self.mooncake.exists(keys)) if held]
            except MooncakeError as error:
                self.health["mooncake"].fail("unreachable", str(error))
                self.results.put(("remote_down", "mooncake"))
            finally:
                self.loads.answered("mooncake")
        self.results.put(("probe", request_id, present))

    def _load(self, runner, job: LoadJob) -> None:
        """Host pages are scattered now; each (tier, group) part of the rest goes to its tier thread, and
        the job completes (a "load" result) when every part has reported or its deadline has passed."""
        parts: dict[tuple[str, int], list] = defaultdict(list)
        for transfer in job.pages:
            parts[(transfer.tier, transfer.group)].append(transfer)
        remote = {part: transfers for part, transfers in parts.items() if part[0] != "host"}
        self.loads.open(job.job_id, remote)
        for (tier, group), transfers in parts.items():
            if tier == "host":
                size = bucket(len(transfers), TRANSFER_BUCKETS)
                slots = _padded([t.slot for t in transfers], size)
                pages = _padded([t.page for t in transfers], size)
                runner.kv_pages = self.mover.host_load(runner.kv_pages, group, self.host_pools[group], slots, pages)
            else:
                self._submit(tier, 0, functools.partial(self._fetch, tier, job.job_id, group, transfers))
        if not remote:
            self._part_done(job.job_id, None, {})

    def _fetch(self, tier: str, job_id: int, group: int, transfers: list) -> None:
        page_bytes = self.mover.page_bytes(group)
        values = self.mover.empty_values(group, len(transfers))
        pages: list[int] = []
        rows: list[int] = []
        failed: dict = {}
        for transfer in transfers:
            key = (group, transfer.key)
            if self.loads.given_up(job_id):  # the request went on without it: fetch no more
                break
            if not self.health[tier].usable():
                self.stats.add("load_failures", tier, reason="degraded")
                failed[key] = ("degraded", f"the {tier} tier is out of use ({self.health[tier].reason})")
                continue
            try:
                if tier == "disk":
                    data = self.disk.read(key, page_bytes)
                else:
                    data = self.mooncake.get(key, page_bytes)
            except KeyError:  # the disk tier dropped the file from its index; Mooncake evicted the object
                self.stats.add("load_failures", tier, reason="missing")
                failed[key] = ("missing", f"{tier} KV page {transfer.key.hex()[:16]} of group {group} is gone")
                continue
            except CorruptCheckpointError as error:  # the disk tier deleted the file
                self.stats.add("load_failures", tier, reason="checksum")
                failed[key] = ("checksum", str(error))
                continue
            except MooncakeError as error:
                self.stats.add("load_failures", tier, reason="error")
                self.health[tier].fail("unreachable", str(error))
                self.results.put(("remote_down", tier))
                failed[key] = ("error", str(error))
                continue
            finally:
                self.loads.answered(tier)
            self.mover.put_payload(values, len(rows), group, data)
            rows.append(len(rows))
            pages.append(transfer.page)
        self.loads.fetched(job_id, (tier, group))  # the padding and the device copy below are no tier's delay
        if pages:  # pad to a compiled size and start the host-to-device copy here, off the step path
            size = bucket(len(pages), TRANSFER_BUCKETS)
            axis = self.mover.page_axis
            values = np.take(values, np.arange(len(pages)), axis=axis)
            if size != len(pages):
                last = np.take(values, [len(pages) - 1], axis=axis)
                values = np.concatenate([values, np.repeat(last, size - len(pages), axis=axis)], axis=axis)
            values = self.mover.to_device(values)
            pages = _padded(pages, size)
        self._fetched.put((job_id, (tier, group), values, pages, failed))

    def _scatter_into(self, runner, group: int, values, pages: np.ndarray) -> None:
        """Write fetched pages (already on the device, padded) into the group's pages."""
        runner.kv_pages = self.mover.scatter(runner.kv_pages, group, values, pages)

    def _part_done(self, job_id: int, part, failed: dict) -> None:
        if part is None:  # a job of host pages only: done at dispatch
            self.results.put(("load", job_id, failed))
            return
        done = self.loads.part_done(job_id, part, failed)
        if done is not None:
            self.results.put(("load", job_id, done))

    def _timed_out(self, tier: str, pages: int) -> None:
        """A load waited `load_timeout_s` on `tier` without its thread answering: the thread is stuck (a dead
        peer, a hung disk). Take the tier out of use so that no other request waits on it; Mooncake
        forgets what it held."""
        self.stats.add("load_failures", tier, pages, reason="timeout")
        self.health[tier].fail("timeout", f"a load waited {self.loads.timeout_s:g} s without an answer from it")
        if tier == "mooncake":
            self.results.put(("remote_down", tier))

    def close(self) -> None:
        for tier in self._queues:
            self._queues[tier].put((99, 1 << 62, None))
        for thread in self._threads:
            thread.join(timeout=30)
        if self.mooncake is not None:
            self.mooncake.close()


# -- construction -----------------------------------------------------------------------------------
def offload_namespace(model_cfg, params, page_size: int, numerics: str, layout: str = "") -> str:
    """A name for this model's pages in shared tiers: its config, page size, numerics, parallel `layout`
    (a laid-out page is every device's part of it) and a fingerprint of its weights (a page written under
    other weights, numerics or layout is never read back)."""
    digest = hashlib.sha256(repr((model_cfg, page_size, numerics, *([layout] if layout else []))).encode())
    for leaf in jax.tree.leaves(params)[:8]:
        digest.update(repr((leaf.shape, str(leaf.dtype))).encode())
        digest.update(np.asarray(jax.device_get(leaf.reshape(-1)[:64])).tobytes())
    return digest.hexdigest()[:24]


def tier_entry_score(model_cfg, kv, page_size: int) -> TierEntryScore:
    """The host and disk tiers' eviction score for this model: recompute FLOPs (its active parameters and
    attention width) per byte of each KV group's pages."""
    from agentjax.models.model_size import model_size

    cost = RecomputeCost.for_model(model_size(model_cfg).active_params, model_cfg.num_layers, model_cfg.num_heads,
                                   model_cfg.head_dim)
    return TierEntryScore(cost, [GroupEntries(group.tokens_per_page, page_bytes, group.spec.hit_rule == "checkpoint")
                                 for group, page_bytes in zip(kv.plan.groups, group_page_bytes(model_cfg, kv, page_size))])


def group_page_bytes(model_cfg, kv, page_size: int) -> list[int]:
    """Bytes of one page of each of the manager `kv`'s groups (its layout's, or per-kind buffers')."""
    layout = getattr(kv, "layout", None)
    if layout is not None and layout.mode == "pool":
        return [layout.page_bytes(g) for g in range(len(layout.groups))]
    return [spec.bytes_per_page for spec in kv_buffer_specs(model_cfg, page_size)]


def build_offload(engine_cfg, model_cfg, params, kv, runner=None) -> tuple[OffloadConnector, OffloadWorker]:
    """The connector's two sides for the tiers `engine_cfg` asks for, over `runner`'s KV buffers (one
    device's, or a laid-out runner's); `OffloadTierError` if one cannot start. The host and disk tiers
    choose victims by `tier_entry_score` and recency."""
    stats = OffloadStats()
    health = {name: TierHealth(name, stats) for name in TIER_NAMES}
    parallel = engine_cfg.parallel
    namespace = offload_namespace(model_cfg, params, engine_cfg.block_size, engine_cfg.numerics,
                                  "" if parallel.is_single_device else parallel.name)
    mover = page_mover(model_cfg, engine_cfg.block_size, runner, getattr(kv, "layout", None))
    host = disk = mooncake = None
    host_slots = 0
    if engine_cfg.host_cache_gb > 0:  # a slot holds one page of every group, every device's part of it
        page_bytes = sum(mover.page_bytes(group) for group in range(mover.num_groups))
        host_slots = int(engine_cfg.host_cache_gb * 2**30) // page_bytes
        host = HostPageIndex(len(kv.plan.groups), host_slots, scored=True)
    if engine_cfg.disk_cache_dir:
        disk = DiskTier(engine_cfg.disk_cache_dir, namespace, int(engine_cfg.disk_cache_gb * 2**30), scored=True)
    if engine_cfg.mooncake_master:
        mooncake = MooncakeTier(engine_cfg.mooncake_master, namespace, int(engine_cfg.mooncake_segment_gb * 2**30))
    if host is None and disk is None and mooncake is None:
        raise OffloadTierError("no KV offload tier was asked for (host_cache_gb, disk_cache_dir, mooncake_master)")
    connector = OffloadConnector(kv, host, disk, mooncake, engine_cfg.kv_offload_retention, stats, health,
                                 entry_score=tier_entry_score(model_cfg, kv, engine_cfg.block_size))
    worker = OffloadWorker(model_cfg, engine_cfg.block_size, connector, host_slots, engine_cfg.kv_load_timeout_s,
                           mover=mover)
    logger.warning("KV offload tiers: %s (namespace %s%s)", ", ".join(connector.tiers), namespace,
                   f", {host_slots} host pages" if host_slots else "")
    return connector, worker
