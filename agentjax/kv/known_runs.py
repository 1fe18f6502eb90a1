"""Leading runs of cached pages that a prefix group read from its index, kept for the next turn.

An agent turn re-sends the previous turn's prefix, so most of its pages were found in the cached-page
index one turn ago. Reading them again is one dict probe per page, which is memory-bound on a long
prompt. A remembered run names its prefix by its last block hash (a chained hash names the whole
prefix) and stays valid up to the first of its pages that the pool has unmapped since it was read
(`BlockPool.page_unmapped_at`): an index entry changes only by an unmapping, never by a later
caching of the same key. So a run is checked with one numpy gather instead of one probe per page.
Host only: never imports jax.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from agentjax.kv.hashing import BlockHash


class _Run:
    __slots__ = ("last_key", "pages", "array", "epoch")

    def __init__(self, last_key: BlockHash, pages: list[int], array: np.ndarray, epoch: int):
        self.last_key, self.pages, self.array, self.epoch = last_key, pages, array, epoch


class KnownRuns:
    """Recent runs per first key (`per_key` of them), at most `max_pages` page entries in all."""

    def __init__(self, pool, max_pages: int, per_key: int = 4):
        self.pool = pool
        self.max_pages = max_pages
        self.per_key = per_key
        self._by_first_key: OrderedDict[BlockHash, list[_Run]] = OrderedDict()
        self._num_pages = 0
        self.pages_reused = 0

    def known_prefix(self, keys: list[BlockHash], limit: int) -> tuple[list[int], np.ndarray]:
        """(pages, page array) of the longest remembered run that is a prefix of `keys` and still
        mapped, cut to `limit` pages; empty when none is known."""
        runs = self._by_first_key.get(keys[0]) if keys else None
        best: _Run | None = None
        if runs:
            for run in runs:
                length = len(run.pages)
                if length <= len(keys) and (best is None or length > len(best.pages)) and keys[length - 1] == run.last_key:
                    best = run
        if best is None:
            return [], _EMPTY
        pool = self.pool
        valid = len(best.pages)
        if best.epoch < pool.unmap_count:  # some page was unmapped since: keep the run up to the first of them
            unmapped = pool.page_unmapped_at[best.array] > best.epoch
            if unmapped.any():
                valid = int(unmapped.argmax())
        valid = min(valid, limit)
        self.pages_reused += valid
        if valid == len(best.pages):
            return best.pages, best.array
        return best.pages[:valid], best.array[:valid]

    def remember(self, keys: list[BlockHash], pages: list[int], array: np.ndarray) -> None:
        """Keep `pages`, the cached pages of `keys[:len(pages)]` read now; runs it extends are dropped."""
        length = len(pages)
        if length == 0 or length > self.max_pages:
            return
        first, last_key = keys[0], keys[length - 1]
        runs = self._by_first_key.get(first)
        if runs is None:
            runs = self._by_first_key[first] = []
        else:
            self._by_first_key.move_to_end(first)
            kept = []
            for run in runs:  # equal chained keys at the same depth mean equal prefixes
                if len(run.pages) <= length and keys[len(run.pages) - 1] == run.last_key:
                    self._num_pages -= len(run.pages)
                else:
                    kept.append(run)
            runs[:] = kept
        runs.insert(0, _Run(last_key, pages, array, self.pool.unmap_count))
        self._num_pages += length
        for run in runs[self.per_key:]:
            self._num_pages -= len(run.pages)
        del runs[self.per_key:]
        while self._num_pages > self.max_pages:
            _, dropped = self._by_first_key.popitem(last=False)
            self._num_pages -= sum(len(run.pages) for run in dropped)


_EMPTY = np.zeros(0, dtype=np.int32)
