"""GreedyDual victim order for the host and disk tiers: evict by an entry's score and its recency.

An entry's priority is the inflation when it was added or last used plus its score; the lowest
priority goes first and the inflation rises to it, so an entry that saves little is evicted soon and
one that saves much outlives newer cheap ones only for as long as its score covers. Equal scores give
LRU. The scores are `TierEntryScore`'s recompute FLOPs per byte (agentjax/kv/offload/policies.py).
Host only: never imports jax.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from itertools import compress
from operator import itemgetter

import numpy as np

from agentjax.errors import InvalidRequestError

Scores = Sequence[float] | Callable[[], Sequence[float]]


def _checked(scores: Sequence[float], count: int) -> list[float]:
    """`scores` as floats, one per key and each >= 0 (one C pass for a turn's many pages)."""
    checked = np.asarray(scores, dtype=np.float64)
    if checked.shape != (count,) or not (checked >= 0).all():  # NaN fails too
        raise InvalidRequestError(f"GreedyDualOrder needs one eviction score >= 0 per key: {count} keys, "
                                  f"{checked.size} scores, smallest {checked.min() if checked.size else None}")
    return checked.tolist()


class _Waiting:
    """Entries added while no victim has been asked for: ascending sequence numbers, their keys, and
    their scores, or the callable that gives them (called when a priority is first needed)."""

    __slots__ = ("sequences", "keys", "scores")

    def __init__(self, sequences: Sequence[int], keys: Sequence[Hashable], scores: Scores):
        self.sequences, self.keys, self.scores = sequences, keys, scores

    def resolved_scores(self) -> list[float]:
        if callable(self.scores):
            self.scores = _checked(self.scores(), len(self.keys))
        return self.scores


class GreedyDualOrder:
    """Victim choice by score and recency (GreedyDual), see the module docstring.

    A heap with lazy deletion of (priority, sequence, key, score) tuples; a key's live entry is its
    latest. Until a victim is first asked for (while the heap is empty), new entries wait in batches,
    oldest first, and a waiting key maps to its sequence number alone: a tier with free slots builds no
    heap and no per-key tuple, and a batch added with a callable for its scores never computes them.
    A batch from `add_many` is not even indexed by key until some other call needs the index (then
    every such batch is, in order), so a tier that only fills pays one append per store. Only a pop
    moves the inflation, and a pop first turns the waiting entries into heap tuples, so every waiting
    entry's priority is the inflation then plus its score."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable, float]] = []
        self._waiting: list[_Waiting] = []
        self._waiting_starts: list[int] = []  # each batch's first sequence number, for bisect
        self._num_waiting = 0
        # key -> its live entry: the sequence number of a waiting one, or the heap's tuple. The last
        # `_unindexed` waiting batches are not in it yet (`_index` adds them).
        self._live: dict[Hashable, int | tuple[float, int, Hashable, float]] = {}
        self._unindexed = 0
        self._sequence = 0
        self.inflation = 0.0

    def __len__(self) -> int:
        self._index()
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        self._index()
        return key in self._live

    def add(self, key: Hashable, score: float = 0.0) -> None:
        """Add `key` (or refresh it with a new score)."""
        if not score >= 0:
            raise InvalidRequestError(f"an eviction score must be >= 0, got {score}")
        self._push(key, float(score))

    def add_many(self, keys: Sequence[Hashable], scores: Scores) -> None:
        """`add` for keys not held yet, in order. `scores`: one per key, or a callable giving them; it is
        called (and its scores checked) only when a victim is first asked for, so a tier with free
        slots never computes them."""
        if not callable(scores) or self._heap:
            scores = _checked(scores() if callable(scores) else scores, len(keys))
        if not keys:  # nothing to add (a retention policy may keep none of a turn's pages)
            return
        first = self._sequence + 1
        self._sequence += len(keys)
        sequences = range(first, first + len(keys))
        if self._heap:  # evicting already: the entries go into the heap now
            entries = list(zip(map(self.inflation.__add__, scores), sequences, keys, scores))
            self._live.update(zip(keys, entries))
            self._into_heap(entries)
        else:  # indexed by key when a later call needs it (`_index`)
            self._wait(_Waiting(sequences, tuple(keys), scores))
            self._unindexed += 1
            return
        self._drop_stale()

    def touch(self, key: Hashable) -> None:
        """`key` was used: its priority restarts from the current inflation."""
        self._index()
        entry = self._live.get(key)
        if entry is None:
            return
        if type(entry) is tuple:
            self._push(key, entry[3])
        else:  # waiting: find its batch by sequence number
            batch = self._waiting[bisect_right(self._waiting_starts, entry) - 1]
            self._push(key, batch.resolved_scores()[batch.sequences.index(entry)])

    def remove(self, key: Hashable) -> None:
        self._index()
        self._live.pop(key, None)

    def pop(self) -> Hashable:
        """Take the entry of lowest priority out; KeyError when empty."""
        self._index()
        heap, live = self._heap, self._live
        if self._waiting:  # the waiting live entries become heap tuples (one rebuild when many)
            waiting = self._live_waiting()
            live.update(zip(map(itemgetter(2), waiting), waiting))
            self._clear_waiting()
            self._into_heap(waiting)
        while heap:
            entry = heapq.heappop(heap)
            key = entry[2]
            if live.get(key) is entry:
                del live[key]
                self.inflation = entry[0]
                return key
        raise KeyError("pop from an empty GreedyDualOrder")

    def pop_add(self, key: Hashable, score: float = 0.0) -> Hashable:
        """`pop`, then `add(key, score)` for a key not held (one heap operation for both); the victim."""
        if not score >= 0:
            raise InvalidRequestError(f"an eviction score must be >= 0, got {score}")
        if self._waiting or not self._heap:
            victim = self.pop()
            self._push(key, float(score))
            return victim
        heap, live = self._heap, self._live
        while live.get(heap[0][2]) is not heap[0]:  # stale entries on top
            heapq.heappop(heap)
            if not heap:
                raise KeyError("pop from an empty GreedyDualOrder")
        victim = heap[0]
        del live[victim[2]]
        self.inflation = victim[0]
        score = float(score)
        self._sequence += 1
        entry = (self.inflation + score, self._sequence, key, score)
        live[key] = entry
        heapq.heapreplace(heap, entry)
        self._drop_stale()
        return victim[2]

    def _push(self, key: Hashable, score: float) -> None:
        self._index()
        self._sequence += 1
        if self._heap:
            entry = (self.inflation + score, self._sequence, key, score)
            self._live[key] = entry
            heapq.heappush(self._heap, entry)
        else:
            self._live[key] = self._sequence
            self._wait(_Waiting(range(self._sequence, self._sequence + 1), (key,), [score]))
        self._drop_stale()

    def _index(self) -> None:
        """Index the waiting batches `add_many` left unindexed by key, oldest first (a later entry of a
        key replaces an earlier one, as if each had been indexed when added)."""
        if self._unindexed:
            live = self._live
            for batch in self._waiting[len(self._waiting) - self._unindexed:]:
                live.update(zip(batch.keys, batch.sequences))
            self._unindexed = 0
            self._drop_stale()

    def _wait(self, batch: _Waiting) -> None:
        self._waiting.append(batch)
        self._waiting_starts.append(batch.sequences[0])
        self._num_waiting += len(batch.keys)

    def _into_heap(self, entries: list) -> None:
        """Heap `entries` (one rebuild when they are many)."""
        if len(entries) * 8 > len(self._heap):
            self._heap += entries
            heapq.heapify(self._heap)
        else:
            for entry in entries:
                heapq.heappush(self._heap, entry)

    def _live_waiting(self) -> list[tuple[float, int, Hashable, float]]:
        """The waiting entries that are still their key's live one, as heap tuples, oldest first."""
        live, inflation = self._live, self.inflation
        return [(inflation + score, sequence, key, score)
                for batch in self._waiting
                for sequence, key, score in zip(batch.sequences, batch.keys, batch.resolved_scores())
                if live.get(key) == sequence]

    def _clear_waiting(self) -> None:
        self._waiting, self._waiting_starts, self._num_waiting, self._unindexed = [], [], 0, 0

    def _drop_stale(self) -> None:
        """Mostly replaced or removed entries: keep the live ones only."""
        if len(self._heap) + self._num_waiting <= 4 * len(self._live) + 64:
            return
        live = self._live
        self._heap = [entry for entry in self._heap if live.get(entry[2]) is entry]
        heapq.heapify(self._heap)
        kept = []
        for batch in self._waiting:  # a batch keeps its live entries (and its scores uncomputed)
            alive = [live.get(key) == sequence for sequence, key in zip(batch.sequences, batch.keys)]
            if all(alive):
                kept.append(batch)
            elif any(alive):
                kept.append(_Waiting(list(compress(batch.sequences, alive)), tuple(compress(batch.keys, alive)),
                                     list(compress(batch.resolved_scores(), alive))))
        self._clear_waiting()
        for batch in kept:
            self._wait(batch)
