"""Prefetch: a paused session's pages come back from the offload tiers before its next turn arrives.

The KV policy decides when (`KVPolicy.prefetch(session)` returns the block hashes of the session's
last turn once its next turn is near; `HintAwarePolicy` uses `expected_next_turn_s`); this side of
the offload connector asks it a few times a second, from the scheduler's `poll`, about the
sessions whose turn ended since, and stages a load through the connector's own planning (the same
transfers a waiting request's load would run, for every KV group). The loaded pages become
ordinary cached pages, pinned in the policy for `pin_s` so the eviction order keeps them for the
turn; a turn then finds its prefix on the device instead of waiting in the loading state. Only
free pages nobody pinned are used, so a prefetch never pushes out what the policy protects.
Host only: never imports jax.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

PREFETCH_INTERVAL_S = 0.25  # how often the policy is asked which paused sessions are due
PREFETCH_PIN_S = 30.0  # how long prefetched pages stay pinned for the turn they were loaded for
MAX_PAUSED_SESSIONS = 4096


class SessionPrefetcher:
    """Asks a `KVPolicy` which paused sessions are due and loads their pages through an `OffloadConnector`."""

    def __init__(self, connector, policy, interval_s: float = PREFETCH_INTERVAL_S, pin_s: float = PREFETCH_PIN_S):
        self.connector = connector
        self.policy = policy
        self.interval_s = interval_s
        self.pin_s = pin_s
        self._paused: OrderedDict[Hashable, None] = OrderedDict()  # sessions between turns, oldest first
        self._loading: dict[tuple, np.ndarray] = {}  # owner -> pages the load holds
        self._next_tick = 0.0

    @staticmethod
    def _owner(session_id: Hashable) -> tuple:
        return ("prefetch", session_id)  # never equal to a request id (a str)

    def owns(self, owner) -> bool:
        return owner in self._loading

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    # -- what the scheduler side reports ---------------------------------------------------------
    def on_turn_end(self, request) -> None:
        session_id = getattr(request, "session_id", None)
        if session_id is None:
            return
        self.policy.unpin(self._owner(session_id))  # the turn it was loaded for is over
        if getattr(request.hints, "session_end", False):
            self._paused.pop(session_id, None)
            return
        self._paused[session_id] = None
        self._paused.move_to_end(session_id)
        if len(self._paused) > MAX_PAUSED_SESSIONS:
            self._paused.popitem(last=False)

    def on_request_added(self, request) -> None:
        """The session's next turn is here: nothing left to prefetch for it."""
        session_id = getattr(request, "session_id", None)
        if session_id is not None:
            self._paused.pop(session_id, None)

    # -- the tick ---------------------------------------------------------------------------------
    def tick(self) -> int:
        """Stage the loads of the paused sessions the policy says are due; returns how many it staged."""
        now = self.policy.clock()
        if not self._paused or now < self._next_tick:
            return 0
        self._next_tick = now + self.interval_s
        sessions_due = getattr(self.policy, "sessions_due", None)
        if sessions_due is not None:
            candidates = sessions_due(now, getattr(self.policy, "prefetch_lead_s", 0.0))
        else:
            candidates = list(self._paused)
        staged = 0
        for session_id in candidates:
            if session_id not in self._paused:
                continue
            hashes = self.policy.prefetch(session_id)
            if not hashes:
                continue
            outcome = self._stage(session_id, list(hashes))
            if outcome != "deferred":  # staged, or nothing to load: done until the session's next turn
                del self._paused[session_id]
            staged += outcome == "staged"
        return staged

    def _stage(self, session_id: Hashable, hashes: list) -> str:
        """"staged", "deferred" (no room now: a later tick tries again) or "none" (nothing to load)."""
        connector, kv = self.connector, self.connector.kv
        owner = self._owner(session_id)
        if owner in self._loading:
            return "none"
        num_tokens = len(hashes) * kv.block_size + 1  # +1: a hit never covers a prompt's last token
        device_hit, _ = kv.find_hit(hashes, num_tokens)
        plan = connector.plan_load(hashes, num_tokens, device_hit)
        if plan is None:
            return "none"
        transfers, device = plan
        needed = kv.load_units([t.group for t in transfers], device)
        if needed + connector.watermark > kv.num_free_blocks - kv.pinned_free_units():
            connector.stats.add("prefetch_deferred", "all")  # only pinned pages left to take: keep them
            return "deferred"
        _, held = connector.start_load(owner, transfers, device)
        self._loading[owner] = held
        connector.stats.add("prefetches", "all")
        connector.stats.add("prefetch_pages", "all", len(transfers))
        return "staged"

    def on_loaded(self, owner: tuple, pages: list[int]) -> None:
        """The load finished: release what it held and pin the pages it brought back for the turn."""
        held = self._loading.pop(owner)
        self.connector.kv.release_pages(held)
        if pages:
            self.policy.pin(owner, np.asarray(pages, dtype=np.int64), self.policy.clock() + self.pin_s)
