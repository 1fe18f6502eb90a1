"""The programmable KV policy: which cached pages to keep, pin, prefetch and evict, as one protocol.

`KVPolicy` is what a policy implements: `on_turn_end(TurnEnd)`, `prefetch(session)`,
`evict_order(candidates)`, `pin` / `unpin`. `PagePolicy` is a base that keeps per-page facts (owner
sessions, position in the prompt, recency, use count, pins) and per-session hints in numpy arrays,
so a built-in only writes `priority`. `agentjax.kv.policy_order.PolicyEvictionOrder` plugs any policy
into the block pool: `KVCacheManager(plan, n, eviction_order=PolicyEvictionOrder(policy))`; the engine
does that with its `kv_policy` setting, and its scheduler reports every session turn's end (with the
agent hints) here. Built-ins: `agentjax.kv.policies`.
Host only: never imports jax, never reads or writes page contents.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from agentjax.errors import InvalidRequestError
from agentjax.kv.pins import PinTable

__all__ = ["KVPolicy", "TurnEnd", "PagePolicy", "NO_SESSION"]

NO_SESSION = -1
# Sessions whose last turn's block keys are kept for `prefetch` (the most recent ones).
MAX_SESSION_KEYS = 1024
# Per-session state is compacted (ended sessions forgotten) once this many sessions are known.
COMPACT_SESSIONS_AT = 4096


@dataclass(frozen=True)
class TurnEnd:
    """A finished turn as a policy sees it: the pages that hold its prompt's cached blocks, in
    prompt order (the first block's page first), the clock time, and the agent hints it carried
    (see `agentjax.scheduler.request.AgentHints`). `keys` optionally names the blocks (hashes).
    `pin` is the hint's pin mode ("none", "soft", "session"; None: the caller sends no pin hint) and
    `positions` each page's block index in its KV group (default: its index in `pages`)."""

    session_id: Hashable
    pages: np.ndarray
    now: float
    expected_next_turn_s: float | None = None
    session_end: bool = False
    branch_point: bool = False
    parent_session_id: Hashable | None = None
    keys: Sequence | None = None
    pin: str | None = None
    positions: np.ndarray | None = None

    @classmethod
    def from_hints(cls, session_id: Hashable, pages, now: float, hints=None, keys: Sequence | None = None,
                   positions=None) -> "TurnEnd":
        """From an `AgentHints` (or anything with its field names; None: no hints)."""
        return cls(session_id, np.asarray(pages, dtype=np.int64), now,
                   expected_next_turn_s=getattr(hints, "expected_next_turn_s", None),
                   session_end=bool(getattr(hints, "session_end", False)),
                   branch_point=bool(getattr(hints, "branch_point", False)),
                   parent_session_id=getattr(hints, "parent_session_id", None), keys=keys,
                   pin=getattr(hints, "pin", None),
                   positions=None if positions is None else np.asarray(positions, dtype=np.int64))


class KVPolicy(Protocol):
    """A programmable KV cache policy. Candidates and pages are int page ids of one pool."""

    clock: Callable[[], float]

    def bind(self, num_pages: int) -> None:
        """Size the per-page state for a pool of `num_pages` pages (all empty)."""
        ...

    def on_turn_end(self, turn: TurnEnd) -> None:
        """A turn finished and its prompt's pages are cached (and free unless another turn holds them).
        A turn with no pages and `session_end` ends a session between turns (the agent said it is done)."""
        ...

    def prefetch(self, session_id: Hashable) -> list:
        """Block keys a lower tier should bring back for this session's next turn now (may be empty)."""
        ...

    def evict_order(self, candidates: np.ndarray, count: int | None = None) -> np.ndarray:
        """The first `count` (None: all) of the cached free `candidates` to evict, first victim first."""
        ...

    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        """Keep `pages` until every unpinned candidate is gone, until `expires_at` (None: until unpinned)."""
        ...

    def unpin(self, key: Hashable) -> int:
        ...

    # What the eviction-order adapter reports:
    def on_free(self, pages: np.ndarray) -> None:
        """Pages whose reference count reached zero, the first to evict first (a request's tail first)."""
        ...

    def on_evict(self, pages: np.ndarray) -> None:
        """Pages leave the free set for new content: whatever the policy knew of them is stale."""
        ...


class PagePolicy:
    """Base policy: per-page and per-session state, pins, and `evict_order` from `priority`.

    A subclass defines `priority(pages, now) -> (primary, secondary)`: the candidate with the lowest
    primary is evicted first, then the lowest secondary, then the least recently freed. Pinned
    pages go after every unpinned one, earliest expiry first. `branch_pin` says what a
    `branch_point` turn pins: "none", "next_turn" (its pages, until its `expected_next_turn_s`
    has passed) or "session" (until its session sends `session_end`).
    """

    name = "base"
    branch_pin = "none"

    def __init__(self, clock: Callable[[], float] = time.monotonic, branch_pin: str | None = None):
        self.clock = clock
        if branch_pin is not None:
            if branch_pin not in ("none", "next_turn", "session"):
                raise InvalidRequestError(f"branch_pin must be 'none', 'next_turn' or 'session', got {branch_pin!r}")
            self.branch_pin = branch_pin
        self._session_index: dict[Hashable, int] = {}
        self._session_ids: list[Hashable] = []
        self._session_keys: OrderedDict[int, Sequence] = OrderedDict()
        self._compact_at = COMPACT_SESSIONS_AT
        self.session_next_turn_at = np.zeros(0)  # absolute expected time of the next turn; nan: no hint
        self.session_last_turn_end = np.zeros(0)
        self.session_ended = np.zeros(0, dtype=bool)
        self.session_parent = np.zeros(0, dtype=np.int32)
        self.session_turns = np.zeros(0, dtype=np.int64)  # turns the session has ended so far
        self.pins = PinTable(clock)  # the KV cache's one pin table (agentjax/kv/pins.py)
        self.bind(0)

    # -- state -----------------------------------------------------------------------------------
    def bind(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.recency = np.zeros(num_pages, dtype=np.int64)  # stamp of the last free: larger is newer
        self.owner = np.full(num_pages, NO_SESSION, dtype=np.int32)  # the last session that used the page
        self.owner2 = np.full(num_pages, NO_SESSION, dtype=np.int32)  # the one before it (shared prefixes)
        self.position = np.full(num_pages, -1, dtype=np.int32)  # block index in that session's prompt
        self.uses = np.zeros(num_pages, dtype=np.int32)  # turns that used the content
        self.page_turn = np.zeros(num_pages, dtype=np.int64)  # the owner's turn number that last used it
        self.page_branch = np.zeros(num_pages, dtype=bool)  # part of a branch point's prompt
        self.pins.bind(num_pages)
        self._next_stamp = 1

    # Per-page pin state, kept by the pin table (`generation` is also part of `page_state`).
    @property
    def generation(self) -> np.ndarray:
        return self.pins.generation

    @property
    def pin_count(self) -> np.ndarray:
        return self.pins.count

    @property
    def pin_expiry(self) -> np.ndarray:
        return self.pins.expiry

    @property
    def pinned_evictions(self) -> int:
        return self.pins.pinned_evictions

    def session(self, session_id: Hashable, parent_id: Hashable | None = None) -> int:
        """The index of a session in the per-session arrays (created on first sight)."""
        index = self._session_index.get(session_id)
        if index is None:
            parent = NO_SESSION if parent_id is None else self.session(parent_id)  # may compact: first
            if len(self._session_ids) >= self._compact_at:
                self._forget_ended_sessions()
                parent = NO_SESSION if parent_id is None else self._session_index.get(parent_id, NO_SESSION)
            index = self._session_index[session_id] = len(self._session_ids)
            self._session_ids.append(session_id)
            if index >= len(self.session_ended):
                size = max(64, 2 * len(self.session_ended))
                self.session_next_turn_at = _grown(self.session_next_turn_at, size, np.nan)
                self.session_last_turn_end = _grown(self.session_last_turn_end, size, 0.0)
                self.session_ended = _grown(self.session_ended, size, False)
                self.session_parent = _grown(self.session_parent, size, NO_SESSION)
                self.session_turns = _grown(self.session_turns, size, 0)
            self.session_next_turn_at[index] = np.nan
            self.session_ended[index] = False
            self.session_turns[index] = 0
            self.session_parent[index] = parent
        return index

    def _forget_ended_sessions(self) -> None:
        """Drop the sessions that sent `session_end` (their pages become pages of no session, which every
        built-in ranks as it ranks an ended session's) and renumber the others."""
        count = len(self._session_ids)
        kept = np.flatnonzero(~self.session_ended[:count])
        self._compact_at = max(COMPACT_SESSIONS_AT, 2 * len(kept))
        if len(kept) == count:
            return
        renumber = np.full(count + 1, NO_SESSION, dtype=np.int32)  # [-1] (NO_SESSION) stays NO_SESSION
        renumber[kept] = np.arange(len(kept), dtype=np.int32)
        self.owner = renumber[self.owner]
        self.owner2 = renumber[self.owner2]
        for name in ("session_next_turn_at", "session_last_turn_end", "session_ended", "session_turns"):
            array = getattr(self, name)
            compacted = np.zeros_like(array)
            compacted[:len(kept)] = array[kept]
            setattr(self, name, compacted)
        parent = np.full_like(self.session_parent, NO_SESSION)
        parent[:len(kept)] = renumber[self.session_parent[kept]]
        self.session_parent = parent
        self._session_ids = [self._session_ids[i] for i in kept.tolist()]
        self._session_index = {session_id: i for i, session_id in enumerate(self._session_ids)}
        self._session_keys = OrderedDict((int(renumber[i]), keys) for i, keys in self._session_keys.items()
                                         if renumber[i] != NO_SESSION)

    _STATE_FIELDS = ("recency", "owner", "owner2", "position", "uses", "page_turn", "page_branch", "generation")

    def page_state(self, pages: np.ndarray) -> np.ndarray:
        """What the policy knows of `pages`, one row each (an admission's undo record)."""
        return np.stack([getattr(self, name)[pages].astype(np.int64) for name in self._STATE_FIELDS], axis=1)

    def restore_page_state(self, pages: np.ndarray, state: np.ndarray) -> None:
        state = np.asarray(state, dtype=np.int64).reshape(len(pages), len(self._STATE_FIELDS))
        changed = self.generation[pages] != state[:, -1]
        for column, name in enumerate(self._STATE_FIELDS):
            array = getattr(self, name)
            array[pages] = state[:, column].astype(array.dtype)
        if changed.any():  # an undone eviction: the pins that held those pages hold again
            self.pins.recompute(pages[changed])

    # -- what the adapter reports ------------------------------------------------------------------
    def on_free(self, pages: np.ndarray) -> None:
        count = len(pages)
        self.recency[pages] = np.arange(self._next_stamp, self._next_stamp + count, dtype=np.int64)
        self._next_stamp += count

    def on_evict(self, pages: np.ndarray) -> None:
        self.pins.evicted(pages)
        self.owner[pages] = NO_SESSION
        self.owner2[pages] = NO_SESSION
        self.position[pages] = -1
        self.uses[pages] = 0
        self.page_turn[pages] = 0
        self.page_branch[pages] = False

    # -- the protocol ------------------------------------------------------------------------------
    def on_turn_end(self, turn: TurnEnd) -> None:
        index = self.session(turn.session_id, turn.parent_session_id)
        pages = np.asarray(turn.pages, dtype=np.int64)
        if len(pages) and not (0 <= pages.min() and pages.max() < self.num_pages):
            raise InvalidRequestError(f"turn pages must lie in [0, {self.num_pages}), got "
                                      f"[{pages.min()}, {pages.max()}]")
        if turn.positions is not None and len(turn.positions) != len(pages):
            raise InvalidRequestError(f"a turn end gives {len(turn.positions)} positions for {len(pages)} pages")
        self.session_last_turn_end[index] = turn.now
        expected = turn.expected_next_turn_s
        self.session_next_turn_at[index] = np.nan if expected is None else turn.now + float(expected)
        self.session_ended[index] = turn.session_end
        if turn.keys is not None:
            self._session_keys[index] = turn.keys
            self._session_keys.move_to_end(index)
            if len(self._session_keys) > MAX_SESSION_KEYS:
                self._session_keys.popitem(last=False)
        if len(pages):
            owners = self.owner[pages]
            self.owner2[pages] = np.where(owners != index, owners, self.owner2[pages])
            self.owner[pages] = index
            self.position[pages] = (np.arange(len(pages), dtype=np.int32) if turn.positions is None
                                    else turn.positions.astype(np.int32))
            self.uses[pages] += 1
            self.session_turns[index] += 1
            self.page_turn[pages] = self.session_turns[index]
        if turn.branch_point:
            self.page_branch[pages] = True
            if self.branch_pin == "session" or (self.branch_pin == "next_turn" and expected is None):
                self.pin(("branch", turn.session_id), pages, None)
            elif self.branch_pin == "next_turn":
                self.pin(("branch", turn.session_id), pages, turn.now + float(expected))
        if turn.session_end:
            self.unpin(("branch", turn.session_id))
            self._session_keys.pop(index, None)

    def prefetch(self, session_id: Hashable) -> list:
        """The base policy prefetches nothing; see `HintAwarePolicy.prefetch`."""
        return []

    def left_behind(self, pages: np.ndarray) -> np.ndarray:
        """Per page: its owner's latest turn did not use it (the conversation moved past it, as
        after a compaction), unless it belongs to a branch point's prompt."""
        owners = self.owner[pages]
        if not self._session_ids:  # no turn has ended yet: every page belongs to no session
            return np.zeros(len(pages), dtype=bool)
        latest = self.session_turns[np.where(owners == NO_SESSION, 0, owners)]
        return (owners != NO_SESSION) & (self.page_turn[pages] < latest) & ~self.page_branch[pages]

    def priority(self, pages: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def evict_order(self, candidates: np.ndarray, count: int | None = None) -> np.ndarray:
        candidates = np.asarray(candidates, dtype=np.int64)
        count = len(candidates) if count is None else min(count, len(candidates))
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        now = self.clock()
        pins = self.pins
        if pins.active:
            pins.expire(now)
        pinned = pins.count[candidates] > 0 if pins.active else None
        if pinned is None or not pinned.any():
            return self._lowest(candidates, count, now)
        unpinned = candidates[~pinned]
        if count <= len(unpinned):
            return self._lowest(unpinned, count, now)
        held = candidates[pinned]
        order = np.lexsort((self.recency[held], pins.expiry[held]))[:count - len(unpinned)]
        return np.concatenate([self._lowest(unpinned, len(unpinned), now), held[order]])

    def _lowest(self, pages: np.ndarray, count: int, now: float) -> np.ndarray:
        """The `count` pages of lowest (primary, secondary, recency), in that order. One partition
        per key over the pages still tied, so O(len(pages)) even when most of them tie."""
        if count == 0:
            return pages[:0]
        primary, secondary = self.priority(pages, now)
        keys = (primary, secondary, self.recency[pages])
        chosen: list[np.ndarray] = []
        remaining, need = np.arange(len(pages)), count
        for key in keys:
            if need >= len(remaining):
                break
            values = key[remaining]
            kth = np.partition(values, need - 1)[need - 1]
            below = remaining[values < kth]
            chosen.append(below)
            need -= len(below)
            remaining = remaining[values == kth]
        chosen.append(remaining[:need])
        picked = np.concatenate(chosen) if len(chosen) > 1 else chosen[0]
        order = np.lexsort((keys[2][picked], keys[1][picked], keys[0][picked]))
        return pages[picked[order]]

    # -- pins (the pin table's) -------------------------------------------------------------------
    def pin(self, key: Hashable, pages, expires_at: float | None = None) -> int:
        """Pin the distinct non-null `pages` under `key`, replacing its set; returns how many."""
        return self.pins.pin(key, pages, expires_at)

    def unpin(self, key: Hashable) -> int:
        """Release `key`'s pin now; returns how many pages it still protected (0 if none)."""
        return self.pins.unpin(key)

    def num_pinned(self) -> int:
        return self.pins.num_pinned()[0]


def _grown(array: np.ndarray, size: int, fill) -> np.ndarray:
    grown = np.full(size, fill, dtype=array.dtype)
    grown[:len(array)] = array
    return grown
