"""The scheduler side of the KV offload connector: which pages a tier can give back, and which to store.

Split as in vLLM's connector API. This side is host-only and cheap: `lookup` counts a prompt's pages
per tier from in-memory indexes; `hold` (the scheduler's `prepare_load`) decides at admission that a
waiting request's longer prefix sits in the tiers, reserves device pages for it and parks the request
while the worker copies; `on_turn_end` (`prepare_store`) picks a finished turn's pages by the
retention policy (`store_plan.StorePlanner`); a paused session's pages come back before its next turn when the KV policy
says it is due (`prefetch.SessionPrefetcher`). All hand `KVTransfers` to the worker side (`agentjax.runner.offload_worker`) in
the scheduler's output; the worker reports back through `results`. A loaded page becomes an ordinary
cached page of the pool, so the admission that follows is the usual prefix hit: the state checkpoints
of a recurrent group are restored by the manager's pending copies as for any hit. Keys are
(group, chained block hash), equal across replicas and restarts. Never imports jax.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from agentjax.kv.groups import CheckpointGroup
from agentjax.kv.offload.disk import DiskTier, TierKey
from agentjax.kv.offload.host import HostPageIndex
from agentjax.kv.offload.prefetch import SessionPrefetcher
from agentjax.kv.offload.remote_keys import RemoteKeys
from agentjax.kv.offload.store_plan import StorePlanner
from agentjax.kv.offload.tiers import TIER_NAMES, OffloadStats, TierHealth, log_failed_load
from agentjax.kv.offload.transfers import KVTransfers, LoadJob, PageTransfer, ResultQueue, StoreJob
from agentjax.kv.offload.union import IN_TIER, TIER_OF, forget_runs, union_groups

__all__ = ["OffloadConnector", "KVTransfers", "LoadJob", "PageTransfer", "ResultQueue", "StoreJob"]

PROBE_WAIT_S = 0.2  # how long a new request waits for the Mooncake pool to say which of its pages it holds


@dataclass
class _Held:
    """A waiting request the connector parked: probing a remote tier, loading, or loaded."""

    request: object
    state: str  # "probing" | "probed" | "loading" | "ready"
    deadline: float = 0.0
    job_id: int = -1
    held_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    abandoned: bool = False
    parked: bool = False  # out of the scheduler's waiting queue until `poll` hands it back


class OffloadConnector:
    """Scheduler side: lookups, load staging and store selection over the host, disk and Mooncake tiers."""

    def __init__(self, kv, host: HostPageIndex | None = None, disk: DiskTier | None = None, mooncake=None,
                 retention: str = "interval", stats: OffloadStats | None = None,
                 health: dict[str, TierHealth] | None = None, min_load_tokens: int | None = None,
                 probe_wait_s: float = PROBE_WAIT_S, prefetch: bool = True, entry_score=None):
        self.kv = kv
        self.host, self.disk, self.mooncake = host, disk, mooncake
        self.stats = stats or OffloadStats()
        self.health = health or {name: TierHealth(name, self.stats) for name in TIER_NAMES}
        self.tiers = [name for name, tier in zip(TIER_NAMES, (host, disk, mooncake)) if tier is not None]
        self.results = ResultQueue()
        self.min_load_tokens = min_load_tokens or kv.block_size
        self.probe_wait_s = probe_wait_s
        self._union = union_groups(kv, self._tier_of, host)
        self._known_remote = RemoteKeys()  # keys the Mooncake pool holds
        self.stores = StorePlanner(kv, host, disk, mooncake, self.health, self._known_remote, entry_score, retention)
        self._held: dict[str, _Held] = {}
        self._jobs: dict[int, str] = {}  # load job id -> request id
        self._job_transfers: dict[int, list[PageTransfer]] = {}
        self._attempted: dict[str, int] = {}  # request id -> preemption count of its load attempt
        # request id -> (preemption count, free pages its last planned load needed) while it waits for room
        self._deferred: dict[str, tuple[int, int]] = {}
        self._ids = itertools.count(1)
        self._transfers = KVTransfers()
        self._ready: list = []
        # Paused sessions' pages, loaded back when the pool's KV policy says their next turn is near.
        policy = kv.kv_policy
        self.prefetcher = SessionPrefetcher(self, policy) if prefetch and policy is not None else None

    # -- lookups ---------------------------------------------------------------------------------
    def _tier_of(self, key: TierKey) -> int | None:
        if self.host is not None and self.host.contains(key):
            return IN_TIER["host"]
        if self.disk is not None and self.disk.contains(key) and self.health["disk"].usable():
            return IN_TIER["disk"]
        if self.mooncake is not None and key in self._known_remote and self.health["mooncake"].usable():
            return IN_TIER["mooncake"]
        return None

    def lookup(self, token_ids, cache_salt: str | None = None) -> dict[str, int]:
        """Pages of the prompt's longest prefix servable from the device pool and the tiers, per tier
        (the nearest tier holding each page): `{"device": n, "host": n, "disk": n, "mooncake": n}`."""
        _, hashes, device_hit, reuse = self.kv.prepare(token_ids, cache_salt)
        counts = dict.fromkeys(("device", *TIER_NAMES), 0)
        if not hashes:
            return counts
        if not self._any_tier_beyond(hashes, device_hit):  # the device's own hit is the answer
            counts["device"] = sum(len(pages) for pages, _ in reuse)
            return counts
        forget_runs(self._union)
        _, reuse = self.kv.find_hit(hashes, len(token_ids), self._union)
        for entries, _ in reuse:  # tier codes are negative, page ids positive: count in C
            in_tiers = 0
            for tier in self.tiers:
                found = entries.count(IN_TIER[tier])
                counts[tier] += found
                in_tiers += found
            counts["device"] += len(entries) - in_tiers
        return counts

    # -- the request lifecycle, as the scheduler calls it ----------------------------------------
    @property
    def num_held(self) -> int:
        """Requests parked here, out of the scheduler's waiting queue (probing a remote tier, or loading)."""
        return sum(held.parked for held in self._held.values())

    @property
    def waiting_on_tiers(self) -> bool:
        """Whether a parked request or a prefetch waits for a tier (an idle engine waits, not spins)."""
        return self.num_held > 0 or (self.prefetcher is not None and self.prefetcher.num_loading > 0)

    def on_request_added(self, request) -> None:
        """Ask the Mooncake pool which of the request's pages it holds (pages other replicas or an
        earlier run stored); the request waits up to `probe_wait_s` for the answer."""
        if self.prefetcher is not None:
            self.prefetcher.on_request_added(request)
        if self.mooncake is None or not self.health["mooncake"].usable():
            return
        _, hashes, _, _ = self.kv.prepare(request.all_token_ids, request.cache_salt)
        unknown = []
        for group in self.kv.groups:
            cached = self.kv.cached_index(group.group_id)
            for block_hash in group.page_keys(hashes):
                key = (group.group_id, block_hash)
                if key not in self._known_remote and block_hash not in cached:
                    unknown.append(key)
        if unknown:
            self._transfers.probes.append((request.request_id, unknown))
            self._held[request.request_id] = _Held(request, "probing", time.monotonic() + self.probe_wait_s)

    def hold(self, request, token_ids: list[int] | None = None) -> bool:
        """At admission: True when the request must wait (its probe is out, or its prefix is being
        loaded from a tier, which this call may start). False: admit it now. `token_ids`: the request's
        `all_token_ids` when the caller has the list already (the admission that follows passes the same
        list to the KV manager, which then reuses this call's hashes)."""
        held = self._held.get(request.request_id)
        if held is not None and held.state == "probing":
            if time.monotonic() < held.deadline:
                held.parked = True
                return True
            held.state = "probed"  # the pool is slow to answer: go on with what is known
        if held is not None and held.state in ("loading",):
            held.parked = True
            return True
        if held is not None and held.state == "ready":
            return False
        if self._attempted.get(request.request_id) == request.num_preemptions:
            return False
        deferred = self._deferred.get(request.request_id)
        if deferred is not None and deferred[0] == request.num_preemptions and self.kv.num_free_blocks < deferred[1]:
            return False  # no room yet for the load it planned last time: planning again would not find any
        if held is not None:
            del self._held[request.request_id]
        return self._stage_load(request, request.all_token_ids if token_ids is None else token_ids)

    def _stage_load(self, request, tokens: list[int]) -> bool:
        """Start loading the request's prefix from the tiers if they extend its device hit. One load per
        admission; a pool without room for the staged pages leaves the decision to a later step (the
        admission needs at least as many free pages, so the request waits for room either way)."""
        kv = self.kv
        _, hashes, device_hit, _ = kv.prepare(tokens, request.cache_salt)
        self._attempted[request.request_id] = request.num_preemptions
        if device_hit + self.min_load_tokens > len(tokens) - 1:
            return False
        plan = self.plan_load(hashes, len(tokens), device_hit)
        if plan is None:
            return False
        transfers, device = plan
        needed = kv.load_units([t.group for t in transfers], device) + self.watermark
        if needed > kv.num_free_blocks:
            del self._attempted[request.request_id]  # no room to stage now: decide again once pages free up
            self._deferred[request.request_id] = (request.num_preemptions, needed)
            self.stats.add("load_deferred", "all")
            return False
        self._deferred.pop(request.request_id, None)
        job_id, held_pages = self.start_load(request.request_id, transfers, device)
        self._held[request.request_id] = _Held(request, "loading", job_id=job_id, held_pages=held_pages, parked=True)
        self.stats.add("load_requests", "all")
        return True

    @property
    def watermark(self) -> int:
        """Free pages a load leaves for the running requests."""
        return max(1, self.kv.capacity_units // 100)

    def plan_load(self, hashes: list, num_tokens: int, device_hit: int) -> tuple[list[PageTransfer], np.ndarray] | None:
        """The page transfers that extend a device hit of `device_hit` tokens (of a prompt of `num_tokens`
        tokens whose blocks are `hashes`) from the tiers, and the device pages the longer hit reuses;
        None when the tiers add fewer than `min_load_tokens` tokens."""
        if not hashes or not self._any_tier_beyond(hashes, device_hit):
            return None
        forget_runs(self._union)
        hit, reuse = self.kv.find_hit(hashes, num_tokens, self._union)
        if hit < device_hit + self.min_load_tokens:
            return None
        entries_of = [np.asarray(entries, dtype=np.int64) for entries, _ in reuse]
        transfers = []
        for group, entries, (_, start) in zip(self.kv.groups, entries_of, reuse):
            missing = np.flatnonzero(entries < 0).tolist()
            if not missing:
                continue
            keys = group.page_keys(hashes)
            group_id = group.group_id
            slots = self.host.group_slots(group_id) if self.host is not None else {}
            checkpoint = hit // group.tokens_per_page - 1 if isinstance(group, CheckpointGroup) else None
            for i, code in zip(missing, entries[missing].tolist()):  # only the pages a tier gives back
                index = start + i if checkpoint is None else checkpoint
                tier = TIER_OF[code]
                slot = slots.get(keys[index], 0) if tier == "host" else 0
                transfers.append(PageTransfer(group_id, keys[index], 0, tier, slot, keys[index - 1] if index else None))
        if not transfers:
            return None
        device = np.unique(np.concatenate([entries[entries >= 0] for entries in entries_of]))
        return transfers, device

    def start_load(self, owner: str, transfers: list[PageTransfer], device: np.ndarray) -> tuple[int, np.ndarray]:
        """Stage a planned load for `owner` (a request id, or a prefetch's name): references on the hit's
        device pages and new pages for the transfers, and a load job for the worker. Returns the job id
        and the pages to release once the load is done."""
        kv = self.kv
        kv.hold_pages(device)  # the hit's resident pages must outlive the load
        staged = kv.take_load_pages([transfer.group for transfer in transfers])
        for transfer, page in zip(transfers, staged.tolist()):
            transfer.page = page
        if self.host is not None:  # the host pages are in use again
            for transfer in transfers:
                if transfer.tier == "host":
                    self.host.touch((transfer.group, transfer.key))
        job = LoadJob(next(self._ids), owner, transfers)
        self._jobs[job.job_id] = owner
        self._job_transfers[job.job_id] = transfers
        self._transfers.loads.append(job)
        return job.job_id, np.concatenate([staged.astype(np.int64), device[::-1]])

    def _any_tier_beyond(self, hashes: list, device_hit: int) -> bool:
        """Cheap pre-check: does any tier hold a page a longer hit would need (the first page past the
        device hit of each group, or a later checkpoint)?"""
        for group in self.kv.groups:
            keys = group.page_keys(hashes)
            first = device_hit // group.tokens_per_page
            candidates = keys[first:] if isinstance(group, CheckpointGroup) else keys[first:first + 1]
            if any(self._tier_of((group.group_id, key)) is not None for key in candidates):
                return True
        return False

    def on_admitted(self, request) -> None:
        """The request left the waiting queue for the running batch: forget its load and probe."""
        self._attempted.pop(request.request_id, None)
        self._deferred.pop(request.request_id, None)
        held = self._held.pop(request.request_id, None)
        if held is not None and len(held.held_pages):  # a probed request holds none; a loaded one no more
            self.kv.release_pages(held.held_pages)

    def drop(self, request) -> None:
        """The request ended while parked (an abort): release what it held once no copy can write it."""
        self._attempted.pop(request.request_id, None)
        self._deferred.pop(request.request_id, None)
        held = self._held.get(request.request_id)
        if held is None:
            return
        if held.state == "loading":
            held.abandoned = True  # the worker may still write the staged pages: release on completion
            return
        del self._held[request.request_id]
        if len(held.held_pages):
            self.kv.release_pages(held.held_pages)

    def poll(self) -> list:
        """Apply the worker's completions; returns the parked requests that may be admitted now."""
        for item in self.results.drain():
            kind = item[0]
            if kind == "load":
                self._finish_load(item[1], item[2])
            elif kind == "stored":
                _, tier, keys = item
                if tier == "mooncake":
                    for key in keys:
                        self._known_remote.remember(key)
            elif kind == "remote_down":
                self.forget_remote()
            elif kind == "probe":
                _, request_id, present = item
                for key in present:
                    self._known_remote.remember(key)
                held = self._held.get(request_id)
                if held is not None and held.state == "probing":
                    held.state = "probed"
                    self._hand_back(held)
        if self.prefetcher is not None:
            self.prefetcher.tick()
        if self.mooncake is not None:  # probes only exist with a Mooncake tier
            now = time.monotonic()
            for held in self._held.values():
                if held.state == "probing" and now >= held.deadline:
                    held.state = "probed"
                    self._hand_back(held)
        if not self._ready:
            return []
        ready, self._ready = self._ready, []
        return ready

    def _hand_back(self, held: _Held) -> None:
        if held.parked:  # else it never left the waiting queue
            held.parked = False
            self._ready.append(held.request)

    def forget_remote(self) -> None:
        """The Mooncake pool went away (its master died): nothing it held is known any more."""
        self._known_remote.clear()

    def _finish_load(self, job_id: int, failed: dict) -> None:
        """A load job completed; `failed` maps the keys of the pages it could not load to (reason, detail).
        Loaded pages become cached pages and every page the load held is released at once: the admission
        still hits the loaded prefix (released pages are evicted last), a failed page's recompute has its
        room, and a request ahead of this one (a higher priority, a preempted one) never waits on pages
        this one holds. Mooncake forgets the failed keys (the disk tier deleted its bad files itself), and
        one warning says what failed. The request goes back to the waiting queue either way."""
        owner = self._jobs.pop(job_id, None)
        transfers = self._job_transfers.pop(job_id, [])
        held = self._held.get(owner)
        prefetched = held is None and self.prefetcher is not None and self.prefetcher.owns(owner)
        if not prefetched and (held is None or held.job_id != job_id):
            return
        kv = self.kv
        loaded: dict[str, int] = {}
        pages: list[int] = []
        for transfer in transfers:
            key = (transfer.group, transfer.key)
            if key in failed:
                if transfer.tier == "mooncake":
                    self._known_remote.forget(key)
                continue
            if kv.cache_loaded_page(transfer.page, transfer.group, transfer.key, transfer.parent):
                loaded[transfer.tier] = loaded.get(transfer.tier, 0) + 1
                pages.append(transfer.page)
        for tier, count in loaded.items():
            self.stats.add("pages_loaded", tier, count)
        if failed:
            self.stats.add("failed_loads", "all")
            log_failed_load(owner, transfers, failed)
        if prefetched:
            self.prefetcher.on_loaded(owner, pages)
            return
        kv.release_pages(held.held_pages)
        held.held_pages = held.held_pages[:0]
        if held.abandoned:
            del self._held[owner]
            return
        held.state = "ready"
        self._hand_back(held)

    # -- stores ----------------------------------------------------------------------------------
    def on_turn_end(self, request) -> None:
        """`prepare_store`: the finished turn's cached pages that the retention policy keeps, for every
        tier that lacks them (`StorePlanner`). Call before the request's pages are freed."""
        if self.prefetcher is not None:
            self.prefetcher.on_turn_end(request)
        state = self.kv.running(request.request_id)
        if state is None or not state.hashes:
            return
        branch = bool(getattr(request.hints, "branch_point", False))
        self._transfers.stores += self.stores.jobs(state, branch, self._ids)

    def take_transfers(self) -> KVTransfers | None:
        """This step's stores, loads and probes for the worker (None when there are none)."""
        if not self._transfers:
            return None
        transfers, self._transfers = self._transfers, KVTransfers()
        return transfers

    def snapshot(self) -> dict:
        """Counters for `Engine.stats()` and /metrics."""
        return {
            "tiers": list(self.tiers),
            "pages_loaded": {name: self.stats.get("pages_loaded", name) for name in self.tiers},
            "pages_stored": {name: self.stats.get("pages_stored", name) for name in self.tiers},
            "counters": self.stats.snapshot(),
            "degraded": {name: self.health[name].degraded for name in self.tiers},
            "requests_waiting_for_load": sum(1 for h in self._held.values() if h.state == "loading"),
            "prefetches": self.stats.get("prefetches", "all"),
            "pages_prefetched": self.stats.get("prefetch_pages", "all"),
            "host_pages": len(self.host) if self.host is not None else 0,
            "disk_pages": len(self.disk) if self.disk is not None else 0,
            "disk_bytes": self.disk.used_bytes if self.disk is not None else 0,
        }
