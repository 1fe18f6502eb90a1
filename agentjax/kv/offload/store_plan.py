"""Store selection for the offload connector (`prepare_store`): which of a finished turn's cached pages
go to which tier.

The retention policy of each group picks the blocks; pages every storable tier already holds are
skipped (a binary search: a turn extends an earlier turn's prefix); the host tier hands out its slots
(evicting by recency, or by `TierEntryScore` when it was built scored), and the disk and Mooncake tiers
take the rows they lack. The result is one `StoreJob` per group for the worker side. Host only: never
imports jax.
"""
from __future__ import annotations

import functools

from agentjax.kv.block_pool import NULL_PAGE
from agentjax.kv.groups import CheckpointGroup, PrefixGroup
from agentjax.kv.offload.policies import make_retention
from agentjax.kv.offload.transfers import StoreJob


class StorePlanner:
    """Turns a finished turn into store jobs over the host, disk and Mooncake tiers of one connector.

    `known_remote` is the connector's record of the keys the Mooncake pool holds (shared, updated by the
    connector); `health` its per-tier health; `entry_score` gives entries' eviction scores for scored tiers.
    """

    def __init__(self, kv, host, disk, mooncake, health: dict, known_remote, entry_score=None,
                 retention: str = "interval"):
        self.kv = kv
        self.host, self.disk, self.mooncake = host, disk, mooncake
        self.health = health
        self._known_remote = known_remote
        # (group, block index, blocks in the turn) -> the entry's eviction score (`TierEntryScore`), for
        # tiers built with `scored=True`; None: they evict LRU.
        self.entry_score = entry_score
        self.retention = [make_retention(retention, checkpoint=isinstance(g, CheckpointGroup)) for g in kv.groups]
        self._holder_test_cache: dict[tuple, object] = {}  # (group, disk storable, remote storable) -> test

    def jobs(self, state, branch: bool, job_ids) -> list[StoreJob]:
        """The store jobs for a finished turn (`state`: the manager's `RequestKV`; `branch`: its
        branch-point hint; `job_ids`: the connector's id counter), one per group that stores pages."""
        kv = self.kv
        jobs: list[StoreJob] = []
        being_written = kv.pages_being_written()  # a checkpoint not yet copied
        for group, retention, table in zip(kv.groups, self.retention, state.tables):
            group_id, index = group.group_id, kv.cached_index(group.group_id)
            keys = group.page_keys(state.hashes)
            stored = self._stored_prefix(group_id, keys)  # earlier turns stored these already
            unstored = keys[stored:]
            # A prefix group's table holds page j's tokens at j: the request's own pages need no index
            # reads (a page another request cached first holds the same tokens). Other kinds (released
            # window pages, checkpoint copies) are found in the index.
            pages = table.pages[stored:len(keys)] if isinstance(group, PrefixGroup) else None
            if pages is None or len(pages) < len(unstored) or NULL_PAGE in pages:
                pages = list(map(index.get, unstored))  # dict reads in C
            if None in pages or being_written:  # the usual case has every page cached and none being copied
                present = [i for i, page in enumerate(pages) if page is not None and page not in being_written]
                unstored, pages = [unstored[i] for i in present], [pages[i] for i in present]
                positions = [stored + i for i in present]
            else:
                positions = range(stored, len(keys))
            if not pages:
                continue
            chosen = retention.select(unstored, branch_point=branch)
            if self.host is not None and len(chosen) > self.host.num_slots - 1:
                chosen = chosen[: self.host.num_slots - 1]
            if len(chosen) < len(pages):
                picked = chosen.tolist()
                unstored, pages = [unstored[i] for i in picked], [pages[i] for i in picked]
                positions = [positions[i] for i in picked]
            job = StoreJob(next(job_ids), group_id, [], [], [])
            self._add_store_rows(job, unstored, pages, positions, len(keys))
            if job.keys:
                jobs.append(job)
        return jobs

    def _stored_prefix(self, group: int, keys: list) -> int:
        """How many leading pages every tier already holds (a binary search: a turn extends an earlier
        turn's prefix, and chained keys name whole prefixes)."""
        everywhere = self._holder_test(group)
        low, high = 0, len(keys)
        while low < high:
            middle = (low + high + 1) // 2
            if everywhere(keys[middle - 1]):
                low = middle
            else:
                high = middle - 1
        return low

    def _holder_test(self, group: int):
        """A test of whether every tier that takes stores now holds a block of `group`. Built once per group
        and set of storable tiers (a tier's health can change between turns); with the host tier alone it is
        the host slot dict's own `__contains__`, so the usual probe runs in C."""
        disk_ok = self.disk is not None and self.health["disk"].storable()
        remote_ok = self.mooncake is not None and self.health["mooncake"].storable()
        cache_key = (group, disk_ok, remote_ok)
        test = self._holder_test_cache.get(cache_key)
        if test is None:
            tests = []
            if self.host is not None:
                tests.append(self.host.group_slots(group).__contains__)
            if disk_ok:
                tests.append(lambda block_hash: self.disk.contains((group, block_hash)))
            if remote_ok:
                tests.append(lambda block_hash: (group, block_hash) in self._known_remote)
            test = tests[0] if len(tests) == 1 else lambda block_hash: all(holds(block_hash) for holds in tests)
            self._holder_test_cache[cache_key] = test
        return test

    def _add_store_rows(self, job: StoreJob, hashes: list, pages: list, positions, num_blocks: int) -> None:
        """A store job's rows: the pages (block hash, device page, block index in a turn of `num_blocks`
        blocks) for the tiers that lack them and take stores now, with their eviction scores when the
        disk tier weighs one. With the host tier alone the job takes `hashes` and `pages` as they are."""
        group = job.group
        disk = self.disk if self.disk is not None and self.health["disk"].storable() else None
        remote = self._known_remote if self.mooncake is not None and self.health["mooncake"].storable() else None
        if disk is None and remote is None:  # host only: the rows that got a slot
            if self.host is None:  # the other tiers take no stores now
                return
            # the host index computes the scores only when it has to evict (the job needs none)
            scores = (functools.partial(self.entry_score.scores, group, positions, num_blocks)
                      if self.entry_score is not None else None)
            slots = self.host.assign_many(group, hashes, scores)
            if 0 in slots:
                kept = [i for i, slot in enumerate(slots) if slot]
                hashes, pages, slots = [hashes[i] for i in kept], [pages[i] for i in kept], [slots[i] for i in kept]
            job.keys, job.pages, job.host_slots = hashes, pages, slots
            return
        scores = self.entry_score.scores(group, positions, num_blocks) if self.entry_score is not None else None
        slots = self.host.assign_many(group, hashes, scores) if self.host is not None else [0] * len(hashes)
        for i, block_hash in enumerate(hashes):
            key = (group, block_hash)
            to_disk = disk is not None and not disk.contains(key)
            to_remote = remote is not None and key not in remote
            if not (slots[i] or to_disk or to_remote):
                continue
            if to_disk:
                job.disk_rows.append(len(job.keys))
            if to_remote:
                job.mooncake_rows.append(len(job.keys))
            job.keys.append(block_hash)
            job.pages.append(pages[i])
            job.host_slots.append(slots[i])
            if scores is not None:
                job.scores.append(scores[i])
