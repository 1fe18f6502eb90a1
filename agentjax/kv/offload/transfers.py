"""What the two sides of the KV offload connector hand each other: page transfers, the jobs that group
them, one step's `KVTransfers`, and the queue of completion events the worker sends back.

Plain records and a thread-safe queue. Host only: never imports jax.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field

from agentjax.kv.offload.disk import TierKey


@dataclass
class PageTransfer:
    """One page between a device page and a tier (`slot`: the host pool's slot, host tier only)."""

    group: int
    key: bytes
    page: int
    tier: str
    slot: int = 0
    parent: bytes | None = None


@dataclass
class LoadJob:
    job_id: int
    request_id: str
    pages: list[PageTransfer]


@dataclass
class StoreJob:
    """One group's pages to store: row i is device page `pages[i]` named `keys[i]`; it goes to host slot
    `host_slots[i]` (0: not to the host tier) and to the remote tiers listed in `disk_rows` and
    `mooncake_rows` (row indices); `scores[i]`, when given, is row i's eviction score for a scored tier."""

    job_id: int
    group: int
    keys: list[bytes]
    pages: list[int]
    host_slots: list[int]
    disk_rows: list[int] = field(default_factory=list)
    mooncake_rows: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def tier_rows(self, tier: str) -> list[int]:
        if tier == "host":
            return [row for row, slot in enumerate(self.host_slots) if slot]
        return self.disk_rows if tier == "disk" else self.mooncake_rows


@dataclass
class KVTransfers:
    """What one scheduler step hands the worker: stores run first (their pages may be reused this
    step), then loads; probes ask a remote tier which keys it holds."""

    stores: list[StoreJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    probes: list[tuple[str, list[TierKey]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.probes)


class ResultQueue:
    """The worker's completion events: ("load", job id, {failed key: (reason, detail)}), ("stored", tier,
    keys), ("probe", request id, present keys), ("remote_down", tier)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()

    def put(self, item: tuple) -> None:
        self._queue.put(item)

    def drain(self) -> list[tuple]:
        if self._queue.empty():  # the usual step: nothing finished
            return []
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def wait(self, timeout_s: float) -> None:
        """Block until a result arrives (it stays queued) or `timeout_s` passes."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return
        self._queue.put(item)
