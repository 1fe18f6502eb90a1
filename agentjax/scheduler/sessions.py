"""Sessions: a conversation's turns, and the pins that keep its pages cached between turns.

Host only: never imports jax. When a turn finishes, its pages are soft-pinned for a TTL (the
agent's `expected_next_turn_s`, else `DEFAULT_SESSION_TTL_S`) so the next turn, sent after a tool
call, still hits. Pinned pages are evicted only after unpinned ones; `session_end` releases them.
"""
from __future__ import annotations

from agentjax.kv import KVCacheManager
from agentjax.scheduler.request import DEFAULT_SESSION_TTL_S, AgentHints, Request, Session


class SessionTable:
    """Sessions by id, with their pins in the KV manager."""

    # Past this many tracked sessions, sessions idle for four default TTLs are forgotten.
    MAX_TRACKED_SESSIONS = 4096

    def __init__(self, kv: KVCacheManager, default_ttl_s: float = DEFAULT_SESSION_TTL_S):
        self.kv = kv
        self.default_ttl_s = default_ttl_s
        self.clock = kv.clock  # pins expire on the manager's clock
        self.sessions: dict[str, Session] = {}

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = Session(session_id)
        return session

    def on_turn_start(self, session_id: str, request: Request, hints: AgentHints | None) -> None:
        if len(self.sessions) > self.MAX_TRACKED_SESSIONS:
            self.expire_idle(4 * self.default_ttl_s)
        session = self.get(session_id)
        session.request_ids.append(request.request_id)
        session.last_activity = self.clock()
        if hints is not None and hints.parent_session_id:
            session.parent_session_id = hints.parent_session_id

    def on_turn_end(self, request: Request) -> None:
        """Pin the finished turn's pages for the next turn (called before its pages are freed)."""
        session = self.get(request.session_id)
        session.last_activity = now = self.clock()
        hints = request.hints or AgentHints()
        if hints.session_end:
            self.end(session.session_id)
            return
        if hints.pin == "none":
            return
        ttl = hints.expected_next_turn_s if hints.expected_next_turn_s is not None else self.default_ttl_s
        # The next turn arrives after the tool call; keep a margin over the expected time.
        expires_at = None if hints.pin == "session" else now + 1.5 * ttl + 1.0
        session.pin_expires_at = expires_at
        session.pinned_until_end = hints.pin == "session"
        self.kv.pin_request(session.session_id, request.request_id, expires_at=expires_at, now=now)
        if hints.branch_point:  # children fork here: hold the fork point until the session ends
            self.kv.pin_request(f"{session.session_id}#branch", request.request_id, expires_at=None, now=now)

    def end(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        session.ended = True
        self.kv.unpin(session_id)
        self.kv.unpin(f"{session_id}#branch")

    def expire_idle(self, idle_s: float) -> None:
        """Forget sessions idle for longer than `idle_s` (their pins have expired on their own)."""
        cutoff = self.clock() - idle_s
        for session_id in [s for s, v in self.sessions.items() if v.last_activity < cutoff and not v.pinned_until_end]:
            self.sessions.pop(session_id)
