"""KV offload tiers in the planning simulator: the engine's real connector (agentjax/kv/offload/connector.py,
with its retention policy, host-tier index, GreedyDual tier scores and session prefetch) over a worker
that moves no bytes but takes virtual time to "move" them.

`VirtualOffloadWorker` stands in for agentjax/runner/offload_worker.py: it receives the step's
`KVTransfers` as the real worker does and reports completions on the connector's result queue when the
virtual clock reaches them. A page's copy takes its bytes per GPU (each GPU moves its own shard of the
page, in parallel) over the host link (`DeviceSpec.host_link_bw`, PCIe or NVLink-C2C, one queue per
direction), and a disk page also its bytes at the drive's read or write rate (`disk_read_bw`,
`disk_write_bw`), each at `Efficiency.offload` of the peak. The drive serves reads before queued
writes, as the real disk thread runs loads at a higher priority than stores: a read waits for earlier
reads only, and the write queue's next free time moves back by the read's time (writes already given
a completion time keep it). Copies overlap the steps (the
real worker's are asynchronous too) and do not slow them. The disk tier is
`IndexOnlyDiskTier`: the real tier's index and eviction order (GreedyDual by `TierEntryScore`) without
files. Host only: never imports jax.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agentjax.errors import InvalidRequestError
from agentjax.kv.offload.connector import OffloadConnector
from agentjax.kv.offload.disk import DiskTier, TierKey
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.policies import GreedyDualOrder, GroupEntries, RecomputeCost, TierEntryScore
from agentjax.kv.offload.transfers import KVTransfers, LoadJob, StoreJob

GB = 1e9
# Host-tier slots at most: an index this large already holds every page a replay stores (a tiny model's
# pages on a big host tier would otherwise ask for hundreds of millions of slots).
MAX_HOST_SLOTS = 1 << 21


@dataclass(frozen=True)
class OffloadPlan:
    """The tiers of one simulated engine: `host_gb` of host memory and `disk_gb` of local disk per
    GPU (0: no such tier), and the retention policy of the connector ("interval" or "marconi")."""

    host_gb: float = 0.0
    disk_gb: float = 0.0
    retention: str = "interval"

    def __post_init__(self) -> None:
        if self.host_gb < 0 or self.disk_gb < 0 or not self.host_gb + self.disk_gb > 0:
            raise InvalidRequestError(f"an offload plan needs host_gb or disk_gb > 0 (and neither < 0); got "
                                      f"{self.host_gb} and {self.disk_gb}")
        if self.retention not in ("interval", "marconi"):
            raise InvalidRequestError(f"retention {self.retention!r}: expected 'interval' or 'marconi'")

    @classmethod
    def for_device(cls, device, host_share: float = 0.8, disk_share: float = 0.9, disk: bool = True,
                   retention: str = "interval") -> "OffloadPlan":
        """`host_share` of the device table's host memory per GPU, and `disk_share` of its drive."""
        return cls(device.host_memory_bytes * host_share / GB, device.disk_bytes * disk_share / GB if disk else 0.0,
                   retention)

    def describe(self, device) -> str:
        eff = device.efficiency.offload
        parts = []
        if self.host_gb:
            parts.append(f"host tier {self.host_gb:g} GB per GPU over {device.host_link_bw / GB:g} GB/s each way")
        if self.disk_gb:
            parts.append(f"disk tier {self.disk_gb:g} GB per GPU at {device.disk_read_bw / GB:g} GB/s read, "
                         f"{device.disk_write_bw / GB:g} GB/s write")
        return (f"KV offload (the engine's connector, {self.retention} retention, session prefetch): "
                + "; ".join(parts) + f"; copies at {eff:g} of peak, overlapping the steps (agentjax/bench/gpus.py)")


class IndexOnlyDiskTier(DiskTier):
    """The disk tier's index and eviction order, sized in bytes, with no files behind it."""

    def __init__(self, capacity_bytes: float, scored: bool = True):  # no directory: nothing is written
        if capacity_bytes <= 0:
            raise InvalidRequestError(f"the disk tier's size cap must be > 0 bytes, got {capacity_bytes}")
        self.directory = None
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[TierKey, int] = OrderedDict()
        self._order = GreedyDualOrder() if scored else None
        self.used_bytes = 0
        self.evictions = 0

    def _delete_file(self, key: TierKey) -> None:
        """No file stands behind a page."""

    def write(self, key, payload, score: float = 0.0) -> None:
        raise InvalidRequestError("the simulated disk tier holds no page contents; record() its pages")

    def read(self, key, expected_bytes: int):
        raise InvalidRequestError("the simulated disk tier holds no page contents")


class VirtualOffloadWorker:
    """The worker side of the connector on a virtual clock (see the module docstring). `spend(seconds)`
    lets an idle engine wait for a copy (None: the caller advances the clock, as a DEP group does)."""

    def __init__(self, connector: OffloadConnector, clock: Callable[[], float], page_bytes: float, device,
                 spend: Callable[[float], None] | None = None) -> None:
        eff = device.efficiency.offload
        if connector.host is not None and not device.host_link_bw > 0:
            raise InvalidRequestError(f"{device.name} has no host link bandwidth in the GPU table: no host tier")
        if connector.disk is not None and not (device.disk_read_bw > 0 and device.disk_write_bw > 0):
            raise InvalidRequestError(f"{device.name} has no disk bandwidth in the GPU table: no disk tier")
        self.connector, self.clock, self.spend = connector, clock, spend
        self.page_bytes = float(page_bytes)
        self.rates = {"to_host": device.host_link_bw * eff, "to_device": device.host_link_bw * eff,
                      "disk_read": device.disk_read_bw * eff, "disk_write": device.disk_write_bw * eff}
        # when each queue is next idle
        self._free = {"to_host": 0.0, "to_device": 0.0, "disk_read": 0.0, "disk_write": 0.0}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self.busy_s = {"to_host": 0.0, "to_device": 0.0, "disk": 0.0}

    def _occupy(self, queue: str, rate: str, ready: float, pages: int) -> float:
        """When `pages` pages that are ready at `ready` have crossed `queue` at the `rate` bandwidth."""
        seconds = pages * self.page_bytes / self.rates[rate]
        begin = max(ready, self._free[queue])
        self._free[queue] = begin + seconds
        self.busy_s["disk" if queue.startswith("disk") else queue] += seconds
        if queue == "disk_read" and self._free["disk_write"] > begin:  # queued writes wait for the read
            self._free["disk_write"] += seconds
        return self._free[queue]

    def _at(self, due: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (due, next(self._sequence), callback))

    def _release_due(self) -> None:
        now = self.clock()
        while self._events and self._events[0][0] <= now:
            heapq.heappop(self._events)[2]()

    # -- what the engine calls ---------------------------------------------------------------------
    def run(self, runner, transfers: KVTransfers | None) -> None:
        self._release_due()
        if not transfers:
            return
        now = self.clock()
        for job in transfers.stores:
            self._store(job, now)
        for job in transfers.loads:
            self._load(job, now)
        for request_id, _ in transfers.probes:  # no Mooncake pool is simulated: nothing is there
            self.connector.results.put(("probe", request_id, []))

    def next_event_in(self) -> float | None:
        """Seconds until the next copy completes (None: none is under way)."""
        return max(0.0, self._events[0][0] - self.clock()) if self._events else None

    def wait(self, timeout_s: float) -> None:
        """An idle engine with parked requests waits for the next completion (at most `timeout_s`)."""
        pending = self.next_event_in()
        if self.spend is not None:
            self.spend(timeout_s if pending is None else min(timeout_s, pending))
        self._release_due()

    def close(self) -> None:
        self._events.clear()

    # -- stores and loads --------------------------------------------------------------------------
    def _store(self, job: StoreJob, now: float) -> None:
        """One gather of the job's pages to host memory; the disk rows then go to the drive."""
        copied = self._occupy("to_host", "to_host", now, len(job.pages))
        host_rows = job.tier_rows("host")
        if host_rows:
            self.connector.stats.add("pages_stored", "host", len(host_rows))
        disk_rows = job.tier_rows("disk")
        if disk_rows and self.connector.disk is not None:
            done = self._occupy("disk_write", "disk_write", copied, len(disk_rows))
            keys = [(job.group, job.keys[row]) for row in disk_rows]
            scores = [job.scores[row] if job.scores else 0.0 for row in disk_rows]
            self._at(done, lambda: self._stored_on_disk(keys, scores))

    def _stored_on_disk(self, keys: list, scores: list) -> None:
        disk = self.connector.disk
        for key, score in zip(keys, scores):
            disk.record(key, int(self.page_bytes), score)
        self.connector.stats.add("pages_stored", "disk", len(keys))
        self.connector.results.put(("stored", "disk", keys))

    def _load(self, job: LoadJob, now: float) -> None:
        host = [t for t in job.pages if t.tier == "host"]
        disk = [t for t in job.pages if t.tier == "disk"]
        done = now
        if host:
            done = max(done, self._occupy("to_device", "to_device", now, len(host)))
        if disk:
            for transfer in disk:
                self.connector.disk.touch((transfer.group, transfer.key))
            read = self._occupy("disk_read", "disk_read", now, len(disk))
            done = max(done, self._occupy("to_device", "to_device", read, len(disk)))
        keys = [(t.group, t.key) for t in disk]
        self._at(done, lambda: self._loaded(job.job_id, keys))

    def _loaded(self, job_id: int, disk_keys: list) -> None:
        disk = self.connector.disk
        failed = {key: ("missing", "evicted before the read") for key in disk_keys
                  if not disk.contains(key)}  # recomputed
        self.connector.results.put(("load", job_id, failed))


def build_virtual_offload(plan: OffloadPlan, kv, shape, device, page_bytes_per_gpu: float,
                          clock: Callable[[], float], spend: Callable[[float], None] | None):
    """The connector (real) and the virtual worker for one simulated engine's KV manager `kv`; host and
    disk tiers sized by `plan` per GPU, in pages of `page_bytes_per_gpu` (one GPU's shard of a page)."""
    if not page_bytes_per_gpu > 0:
        raise InvalidRequestError(f"page bytes per GPU must be > 0, got {page_bytes_per_gpu}")
    host = disk = None
    if plan.host_gb:
        slots = min(MAX_HOST_SLOTS, max(2, int(plan.host_gb * GB // page_bytes_per_gpu)))
        host = HostPageIndex(len(kv.plan.groups), slots, scored=True)
    if plan.disk_gb:
        disk = IndexOnlyDiskTier(plan.disk_gb * GB, scored=True)
    per_pair = sum(count * stream.flops_per_entry for mixer, count in shape.mixers for stream in mixer.streams)
    score = TierEntryScore(RecomputeCost(shape.active_params, per_pair),
                           [GroupEntries(group.tokens_per_page, max(1, int(page_bytes_per_gpu))) for group in kv.plan.groups])
    connector = OffloadConnector(kv, host, disk, None, plan.retention, entry_score=score)
    return connector, VirtualOffloadWorker(connector, clock, page_bytes_per_gpu, device, spend)
