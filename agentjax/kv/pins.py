"""The one pin table of the KV cache: which pages a session between turns or a fork point keeps, until when.

Every eviction order (`agentjax.kv.eviction.PinnedEvictionOrder`) and every KV policy
(`agentjax.kv.policy.PagePolicy`) keeps its pins here: pin sets by key, expiry on a clock, and a
content generation per page, so a pinned page that is evicted anyway leaves every pin. The table
never picks a victim (its owner does) and never imports jax.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from agentjax.errors import InvalidRequestError

__all__ = ["NULL_PAGE", "Pin", "PinListener", "PinTable", "distinct_pages"]

NULL_PAGE = 0  # the pool's reserved page: never free, never evicted, never pinned


def distinct_pages(pages, dtype=np.int64) -> np.ndarray:
    """The distinct pages other than NULL_PAGE, ascending (a pin's set). A sort and a neighbour test:
    numpy 2.5's `np.unique` takes about 4x as long on a session's few hundred pages."""
    pages = np.sort(np.asarray(pages, dtype=dtype))
    keep = pages != NULL_PAGE
    keep[1:] &= pages[1:] != pages[:-1]
    return pages[keep]


@dataclass
class Pin:
    """One pin set: its distinct pages, each page's content generation when pinned (an eviction ends
    the pin for that page), its expiry on the table's clock (math.inf: until unpinned) and its id."""

    pages: np.ndarray
    generations: np.ndarray
    expires_at: float
    pin_id: int


class PinListener(Protocol):
    """What an owner that files pinned pages apart (the LRU order's pinned tier) hears of pin changes."""

    def pins_grew(self, pages: np.ndarray) -> None:
        """A new pin raised the latest expiry of `pages`."""
        ...

    def pins_released(self, released: np.ndarray, still: np.ndarray) -> None:
        """An unpin (or an expiry) left `released` pinned by nothing and `still` pinned by other keys
        (their latest expiry recomputed)."""
        ...


class PinTable:
    """Pin sets by key over the pages of one pool, with per-page pin counts and latest expiries.

    `pin(key, pages, expires_at)` replaces `key`'s set; `unpin(key)` releases it; a pin whose expiry
    has passed on `clock` is released by `expire()` (every read below calls it). `evicted(pages)` says
    the content of `pages` is gone (their pins end); `restore_generations` undoes that for a rolled-back
    admission. `count`, `expiry` and `generation` are per-page arrays the owner may read.
    """

    def __init__(self, clock: Callable[[], float], page_dtype=np.int64):
        self.clock = clock
        self.page_dtype = page_dtype
        self.listener: PinListener | None = None
        self._pins: dict[Hashable, Pin] = {}
        self._deadlines: list[tuple[float, int, Hashable]] = []  # (expires_at, pin id, key), a heap
        self._next_pin_id = 0
        self.pinned_evictions = 0  # pinned pages evicted anyway (under pressure, or their slab reclaimed)
        self.bind(0)

    def bind(self, num_pages: int) -> None:
        """Size the per-page arrays for a pool of `num_pages` pages (nothing pinned)."""
        self.count = np.zeros(num_pages, dtype=np.int32)
        self.expiry = np.zeros(num_pages, dtype=np.float64)
        self.generation = np.zeros(num_pages, dtype=np.int64)

    # -- reads -----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any pin is held (expired ones included until the next `expire`)."""
        return bool(self._pins)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pins

    def get(self, key: Hashable) -> Pin | None:
        return self._pins.get(key)

    def keys(self) -> list[Hashable]:
        self.expire()
        return list(self._pins)

    def pinned_mask(self, pages: np.ndarray) -> np.ndarray:
        """Which of `pages` (any shape) a live pin protects."""
        self.expire()
        return self.count[pages] > 0

    def num_pinned(self, ref_counts: np.ndarray | None = None) -> tuple[int, int]:
        """(pages under a live pin, of which free: reference count 0 in `ref_counts`; None: none free).
        Reads the pins' pages only, never the whole pool (the server reads it after every step)."""
        self.expire()
        if not self._pins:
            return 0, 0
        pages = distinct_pages(np.concatenate([pin.pages for pin in self._pins.values()]))
        pages = pages[self.count[pages] > 0]
        return len(pages), 0 if ref_counts is None else int(np.count_nonzero(ref_counts[pages] == 0))

    # -- changes ---------------------------------------------------------------------------------
    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        """Pin the distinct non-null `pages` under `key`, replacing its set; returns how many (0 when
        `expires_at` has passed already)."""
        if key in self._pins:
            self.unpin(key)
        expiry = math.inf if expires_at is None else float(expires_at)
        if math.isnan(expiry):
            raise InvalidRequestError("expires_at is NaN; pass a clock time or None (until unpinned)")
        pages = distinct_pages(pages, self.page_dtype)
        if len(pages) and not (0 < pages[0] and pages[-1] < len(self.count)):
            raise InvalidRequestError(f"pinned pages must lie in [1, {len(self.count)}), got "
                                      f"[{pages[0]}, {pages[-1]}]")
        if expiry <= self.clock():
            return 0
        self._pins[key] = Pin(pages, self.generation[pages].copy(), expiry, self._next_pin_id)
        if expires_at is not None:
            heapq.heappush(self._deadlines, (expiry, self._next_pin_id, key))
        self._next_pin_id += 1
        self.count[pages] += 1
        old = self.expiry[pages]
        new = np.maximum(old, expiry)
        self.expiry[pages] = new
        if self.listener is not None:
            self.listener.pins_grew(pages[new > old])
        return len(pages)

    def unpin(self, key: Hashable) -> int:
        """Release `key`'s pin now; returns how many pages it still protected (0 if none)."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return 0
        pages = pin.pages[self.generation[pin.pages] == pin.generations]
        self.count[pages] -= 1
        held = self.count[pages] > 0
        released, still = pages[~held], pages[held]
        self.expiry[released] = 0.0
        if len(still):  # pages another pin holds too: their expiry is the latest of the pins left
            self.recompute(still)
        if not self._pins:
            self._deadlines.clear()
        if self.listener is not None:
            self.listener.pins_released(released, still)
        return len(pages)

    def expire(self, now: float | None = None) -> None:
        """Release every pin whose expiry has passed at `now` (default: the clock's time)."""
        deadlines = self._deadlines
        if not deadlines:
            return
        now = self.clock() if now is None else now
        while deadlines and deadlines[0][0] <= now:
            _, pin_id, key = heapq.heappop(deadlines)
            pin = self._pins.get(key)
            if pin is not None and pin.pin_id == pin_id:
                self.unpin(key)

    def evicted(self, pages: np.ndarray, all_pinned: bool = False) -> None:
        """The content of `pages` is gone: every pin ends for them. Those pinned now count as pinned
        evictions (`all_pinned`: all of them, as the pinned tier files them)."""
        self.pinned_evictions += len(pages) if all_pinned else int(np.count_nonzero(self.count[pages] > 0))
        self.count[pages] = 0
        self.expiry[pages] = 0.0
        self.generation[pages] += 1

    def restore_generations(self, pages: np.ndarray, generations: np.ndarray) -> None:
        """An undone eviction: `pages` hold their former content again, and the pins that held them hold again."""
        changed = self.generation[pages] != generations
        if changed.any():
            self.generation[pages] = generations
            self.recompute(pages[changed])

    def recompute(self, pages: np.ndarray) -> None:
        """Pin count and latest expiry of `pages` from the live pins (after an unpin or an undo)."""
        self.count[pages] = 0
        self.expiry[pages] = 0.0
        if not self._pins or not len(pages):
            return
        wanted = np.zeros(len(self.count), dtype=bool)
        wanted[pages] = True
        for pin in self._pins.values():
            member = wanted[pin.pages]
            if not member.any():
                continue
            member &= self.generation[pin.pages] == pin.generations
            if member.any():
                chosen = pin.pages[member]
                self.count[chosen] += 1
                self.expiry[chosen] = np.maximum(self.expiry[chosen], pin.expires_at)
