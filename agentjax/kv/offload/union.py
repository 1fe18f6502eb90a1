"""The KV manager's groups seen through the offload tiers: which of a prompt's pages the device pool or a
tier could serve, for the connector's lookups and load planning (`agentjax.kv.offload.connector`).

A union group answers the manager's own hit rules (`KVCacheManager.find_hit(..., groups=unions)`)
over an index where a key held only by a tier maps to that tier's code (`IN_TIER`, negative, never a
page id). The prefix kind, the one a long prompt's cost sits in, reuses the device group's memoised
leading run and reads the host tier's dict in C past it, so a lookup with the tiers on adds one
`map` over the pages the device lacks. Host only: never imports jax.
"""
from __future__ import annotations

from agentjax.kv.groups import GroupManager, PrefixGroup, make_group_manager
from agentjax.kv.offload.tiers import TIER_NAMES

# What a union index answers for a key held by a tier instead of the device pool.
IN_TIER = {name: -1 - i for i, name in enumerate(TIER_NAMES)}
TIER_OF = {code: name for name, code in IN_TIER.items()}
HOST = IN_TIER["host"]


class UnionIndex:
    """A group's cached-page index seen through the tiers: a key held only by a tier maps to IN_TIER."""

    def __init__(self, device: dict, group: int, tier_of, host_slots: dict | None = None):
        self.device, self.group, self.tier_of, self.host_slots = device, group, tier_of, host_slots

    def get(self, block_hash, default=None):
        page = self.device.get(block_hash)
        if page is not None:
            return page
        code = self.tier_of((self.group, block_hash))
        return default if code is None else code

    def __contains__(self, block_hash) -> bool:
        return self.get(block_hash) is not None

    def __getitem__(self, block_hash):
        value = self.get(block_hash)
        if value is None:
            raise KeyError(block_hash)
        return value


class UnionPrefixGroup(PrefixGroup):
    """A prefix group over the union index: the device group's leading run (memoised by the manager's
    own lookup of the same prompt), then the tiers' pages past it. The run of one lookup is kept until
    `forget` (the connector calls it before each lookup: tier contents change without a pool version)."""

    device_group: PrefixGroup
    _union_run: tuple | None = None

    def forget(self) -> None:
        self._last_run = self._union_run = None

    def cached_run(self, keys: list, max_pages: int) -> list:
        last = self._union_run
        if last is not None and last[0] is keys and last[1] >= max_pages:
            return last[2][:max_pages] if len(last[2]) > max_pages else last[2]
        run = self.device_group.cached_run(keys, max_pages)
        wanted = min(max_pages, len(keys))
        if len(run) < wanted:
            run = run + self._tier_run(keys, len(run), wanted)
        self._union_run = (keys, max_pages, run)
        return run

    def _tier_run(self, keys: list, start: int, stop: int) -> list:
        """Tier codes of keys[start:stop] until the first key no tier holds."""
        tier_of, group, host_slots = self.index.tier_of, self.group_id, self.index.host_slots
        run: list[int] = []
        position = start
        while position < stop:
            if host_slots is not None:  # the usual case: a run of pages the host tier holds, read in C
                found = list(map(host_slots.get, keys[position:stop]))
                try:
                    count = found.index(None)
                except ValueError:
                    count = len(found)
                run += [HOST] * count
                position += count
                if position == stop:
                    break
            code = tier_of((group, keys[position]))
            if code is None:
                break
            run.append(code)
            position += 1
        return run


def union_groups(kv, tier_of, host=None) -> list[GroupManager]:
    """One union group per group of the manager `kv`, over its pool's index and the tiers (`tier_of(key)`
    -> IN_TIER code or None; `host`: the host index, read in bulk)."""
    unions: list[GroupManager] = []
    for group in kv.groups:
        if isinstance(group, PrefixGroup):  # read the pool the manager's own group reads
            union = UnionPrefixGroup(group.group, group.pool, kv.block_size)
            union.device_group = group
        else:
            union = make_group_manager(group.group, group.pool, kv.block_size)
        host_slots = host.group_slots(group.group_id) if host is not None else None
        union.index = UnionIndex(kv.cached_index(group.group_id), group.group_id, tier_of, host_slots)
        unions.append(union)
    return unions


def forget_runs(unions: list[GroupManager]) -> None:
    for union in unions:
        if isinstance(union, UnionPrefixGroup):
            union.forget()
        else:
            union._last_run = None
