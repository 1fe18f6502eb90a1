"""Sessions: a conversation's turns, reported to the engine's KV policy so its pages outlive the pause.

Host only: never imports jax. When a session's turn finishes, `on_turn_end` hands the KV policy
(`agentjax.kv.policy.KVPolicy`, the engine's `kv_policy` setting) a `TurnEnd`: the cached pages that
serve the turn's prefix in every KV group, their positions, the turn's block hashes (what a lower
tier would bring back for `prefetch`) and the agent hints (`expected_next_turn_s`, `session_end`,
`branch_point`, `pin`, with pin "soft" and the default TTL when a turn carries none). What the
policy does with them (pins, an eviction order, prefetches) is the policy's: the default "hints"
policy pins the pages for a margin over the expected gap, as the engine always has. `end` ends a
session between turns; sessions idle for `IDLE_SESSION_S` are ended too, so a client that never
says goodbye stops holding pages. Without a policy (a KV manager built with a plain eviction order)
turns are only counted.
"""
from __future__ import annotations

import numpy as np

from agentjax.kv import KVCacheManager
from agentjax.kv.policy import TurnEnd
from agentjax.scheduler.request import AgentHints, Request, Session

# A session with no turn for this long is ended in the policy (the traces' p90 pause is 150 s).
IDLE_SESSION_S = 600.0
SWEEP_INTERVAL_S = 60.0
# The hints of a session turn that carries none: a soft pin for the policy's default gap.
DEFAULT_HINTS = AgentHints()


class SessionTable:
    """Sessions by id; their turn ends go to the KV policy."""

    def __init__(self, kv: KVCacheManager, policy=None, keep_block_hashes: bool = False,
                 idle_session_s: float = IDLE_SESSION_S):
        self.kv = kv
        self.policy = policy
        self.keep_block_hashes = keep_block_hashes  # for prefetch (only an offload tier can use them)
        self.idle_session_s = idle_session_s
        self.clock = kv.clock  # the policy's pins expire on the manager's clock
        self.sessions: dict[str, Session] = {}
        self._last_sweep = self.clock()

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id)
        return session

    def on_turn_start(self, session_id: str, request: Request, hints: AgentHints | None) -> None:
        now = self.clock()
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            self.expire_idle(self.idle_session_s)
        session = self.get(session_id)
        session.request_ids.append(request.request_id)
        session.last_activity = now
        if hints is not None and hints.parent_session_id:
            session.parent_session_id = hints.parent_session_id

    def on_turn_end(self, request: Request) -> None:
        """Report the finished turn to the policy (called before its pages are freed)."""
        session = self.get(request.session_id)
        session.last_activity = now = self.clock()
        hints = request.hints or DEFAULT_HINTS
        session.pinned_until_end = hints.pin == "session"
        if hints.session_end:
            self.sessions.pop(session.session_id, None)
            session.ended = True
        if self.policy is None:
            return
        pages, positions = self.kv.serving_pages(request.request_id)
        keys = self.kv.block_hashes(request.request_id) if self.keep_block_hashes and not hints.session_end else None
        parent = hints.parent_session_id or session.parent_session_id
        self.policy.on_turn_end(TurnEnd(
            session.session_id, np.asarray(pages, dtype=np.int64), now,
            expected_next_turn_s=hints.expected_next_turn_s, session_end=hints.session_end,
            branch_point=hints.branch_point, parent_session_id=parent, keys=keys, pin=hints.pin,
            positions=np.asarray(positions, dtype=np.int64)))

    def end(self, session_id: str) -> None:
        """The session is over (the agent said so, or it went idle): its pins go."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.ended = True
        if self.policy is not None:
            self.policy.on_turn_end(TurnEnd(session_id, np.zeros(0, dtype=np.int64), self.clock(), session_end=True))

    def expire_idle(self, idle_s: float) -> None:
        """End the sessions idle for longer than `idle_s` (unless pinned until their `session_end`)."""
        cutoff = self.clock() - idle_s
        for session_id in [s for s, v in self.sessions.items() if v.last_activity < cutoff and not v.pinned_until_end]:
            self.end(session_id)
