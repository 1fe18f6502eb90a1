"""The host tier's index: which KV page each slot of the host page pool holds.

The pool itself is one `pinned_host` array per KV group, owned by the offload worker next to the
model runner (`agentjax.runner.offload_worker`); this index is its scheduler side: a key (group,
block hash) maps to a slot, and a new store evicts a key of its group when the group's slots are
full: the least recently used, or with `scored=True` the one of lowest GreedyDual priority (the
recompute FLOPs per byte the entry saves, `TierEntryScore`, plus recency), so a cheap tail page
goes before a state checkpoint or a prefix's head. Slot 0 is never assigned (transfers pad with it).
Host only: never imports jax, never touches page contents.
"""
from __future__ import annotations

from collections import OrderedDict

from agentjax.errors import OffloadTierError
from agentjax.kv.offload.disk import TierKey
from agentjax.kv.offload.greedy_dual import GreedyDualOrder, Scores


class HostPageIndex:
    """`num_slots` slots per KV group (slot 0 reserved), one eviction order per group (LRU, or
    `GreedyDualOrder` by the entries' scores with `scored=True`)."""

    def __init__(self, num_groups: int, num_slots: int, scored: bool = False):
        if num_slots < 2:
            raise OffloadTierError(f"the host tier needs at least 2 page slots per KV group, got {num_slots}; "
                                   f"raise host_cache_gb")
        self.num_slots = num_slots
        # Unscored, a group's dict keeps its LRU order itself; scored, the GreedyDual order does.
        self._slots: list[dict[bytes, int]] = [{} if scored else OrderedDict() for _ in range(num_groups)]
        self._free: list[list[int]] = [list(range(num_slots - 1, 0, -1)) for _ in range(num_groups)]
        self._orders = [GreedyDualOrder() for _ in range(num_groups)] if scored else None
        self.evictions = 0

    def slot(self, key: TierKey) -> int | None:
        group, block_hash = key
        return self._slots[group].get(block_hash)

    def group_slots(self, group: int) -> dict:
        """The group's block hash -> slot map (read-only: bulk lookups in C via `map(d.get, ...)`)."""
        return self._slots[group]

    def contains(self, key: TierKey) -> bool:
        return key[1] in self._slots[key[0]]

    def touch(self, key: TierKey) -> None:
        slots = self._slots[key[0]]
        if key[1] in slots:
            if self._orders is None:
                slots.move_to_end(key[1])
            else:
                self._orders[key[0]].touch(key[1])

    def assign(self, key: TierKey, score: float = 0.0) -> int:
        """A slot for a new key (the key's own if it has one), evicting one of the group's keys if full
        (the oldest; with `scored`, the lowest priority). `score`: the entry's `TierEntryScore`."""
        group, block_hash = key
        slots = self._slots[group]
        slot = slots.get(block_hash)
        if slot is not None:
            self.touch(key)
            return slot
        free = self._free[group]
        if free:
            slot = free.pop()
        elif self._orders is None:
            _, slot = slots.popitem(last=False)
            self.evictions += 1
        else:
            slot = slots.pop(self._orders[group].pop())
            self.evictions += 1
        slots[block_hash] = slot
        if self._orders is not None:
            self._orders[group].add(block_hash, score)
        return slot

    def assign_new(self, key: TierKey, score: float = 0.0) -> int:
        """`assign` for a key the index does not hold yet; 0 (and nothing changes) if it holds it."""
        return 0 if key[1] in self._slots[key[0]] else self.assign(key, score)

    def assign_many(self, group: int, hashes: list, scores: Scores | None = None) -> list[int]:
        """`assign_new` for each of a store's keys in one group: their slots, 0 for a key the index holds
        already, or for one a later key of the same call evicted again (so no two rows of one store
        share a slot). `scores`: one per key, or a callable giving them (`GreedyDualOrder.add_many`
        calls it only when it has to choose a victim)."""
        slots, free = self._slots[group], self._free[group]
        order = self._orders[group] if self._orders is not None else None
        count = len(hashes)
        if count <= len(free):  # new keys into free slots, in C
            out = free[len(free) - count:][::-1]  # the slots `free.pop()` would give, in that order
            given = list(map(slots.setdefault, hashes, out))  # a held key keeps (and gives) its own slot
            if given == out:  # every key was new: a held key's slot is never a free one
                del free[len(free) - count:]
                if order is not None:
                    order.add_many(hashes, scores if scores is not None else [0.0] * count)
                return out
            for block_hash, slot, held in zip(hashes, out, given):  # some were held: undo, then one by one
                if slot == held:
                    del slots[block_hash]
        if callable(scores):
            scores = scores()
        out: list[int] = []
        rows: dict[bytes, int] = {}  # keys this call assigned -> their row
        for row, block_hash in enumerate(hashes):
            if block_hash in slots:
                out.append(0)
                continue
            score = scores[row] if scores is not None else 0.0
            if free:
                slot = free.pop()
                if order is not None:
                    order.add(block_hash, score)
            else:
                if order is None:
                    victim, slot = slots.popitem(last=False)
                else:  # the victim out and the new key in, one heap operation
                    victim = order.pop_add(block_hash, score)
                    slot = slots.pop(victim)
                self.evictions += 1
                if victim in rows:
                    out[rows.pop(victim)] = 0
            slots[block_hash] = slot
            rows[block_hash] = row
            out.append(slot)
        return out

    def drop(self, key: TierKey) -> None:
        group, block_hash = key
        slot = self._slots[group].pop(block_hash, None)
        if slot is not None:
            self._free[group].append(slot)
            if self._orders is not None:
                self._orders[group].remove(block_hash)

    def __len__(self) -> int:
        return sum(len(slots) for slots in self._slots)
