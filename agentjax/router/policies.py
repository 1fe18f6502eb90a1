"""Routing policies: which healthy replica serves a request, and why (the reason is a metric label).

A policy implements `RoutingPolicy.choose(request, candidates, sessions)`; the router passes only
replicas that are healthy and not yet tried for this request, so a policy never sees a dead one.
Built in: `queue` (least loaded; the baseline and every policy's fallback), `sticky` (a session's
turns stay on one replica; new sessions land by consistent hash), `prefix` (the replica whose KV
events show the longest cached prefix of this prompt), `pools` (first turns on prefill replicas,
later turns on decode replicas), `pd` (prefill/decode disaggregation: a prefill replica computes a
new session's prompt KV, a decode replica loads it by block hash and replies). Policies hold no
I/O. Never imports jax.
"""
from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agentjax.errors import RouterConfigError
from agentjax.router.replicas import Replica
from agentjax.router.routing_request import RoutingRequest

MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen replica; `reason` says why; `moved_from` is the replica the session used last
    when this request leaves it (`move_reason` says why). P/D: `prefill_on` is the prefill replica
    that computes the prompt's KV first (the chosen replica then decodes); `pd_fallback` says why a
    request that wanted that step is served whole by the chosen replica."""

    replica: Replica
    reason: str
    moved_from: Replica | None = None
    move_reason: str | None = None
    prefill_on: Replica | None = None
    pd_fallback: str | None = None


class SessionTable:
    """Session id -> the replica that served its latest turn, and Responses API response id -> (its
    session, the replica that stores it); least recently used out beyond `max_sessions`."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self.replica_of: OrderedDict[str, Replica] = OrderedDict()
        self.responses: OrderedDict[str, tuple[str, Replica]] = OrderedDict()

    def get(self, session_id: str | None) -> Replica | None:
        return self.replica_of.get(session_id) if session_id else None

    def record(self, session_id: str | None, replica: Replica) -> None:
        if not session_id:
            return
        self.replica_of[session_id] = replica
        self.replica_of.move_to_end(session_id)
        while len(self.replica_of) > self.max_sessions:
            self.replica_of.popitem(last=False)

    def record_response(self, response_id: str, session_id: str, replica: Replica) -> None:
        self.responses[response_id] = (session_id, replica)
        self.responses.move_to_end(response_id)
        while len(self.responses) > self.max_sessions:
            self.responses.popitem(last=False)

    def session_of(self, response_id: str | None) -> str | None:
        found = self.responses.get(response_id) if response_id else None
        return found[0] if found else None

    def owner_of(self, response_id: str | None) -> Replica | None:
        """The replica that stores a response (only it can continue or return it)."""
        found = self.responses.get(response_id) if response_id else None
        return found[1] if found else None


class HashRing:
    """Consistent hashing of session ids over replica URLs (`points` virtual nodes each), so a
    replica's loss moves only its own sessions, and every router instance agrees."""

    def __init__(self, replicas: Sequence[Replica], points: int = 64) -> None:
        ring = sorted((_hash(f"{replica.url}#{i}"), index) for index, replica in enumerate(replicas)
                      for i in range(points))
        self.keys = [key for key, _ in ring]
        self.owners = [replicas[index] for _, index in ring]

    def preference(self, session_id: str, eligible: Sequence[Replica]) -> list[Replica]:
        """The eligible replicas in the order met clockwise from the session's point."""
        allowed = set(map(id, eligible))
        start = bisect.bisect(self.keys, _hash(session_id))
        order: list[Replica] = []
        for step in range(len(self.owners)):
            replica = self.owners[(start + step) % len(self.owners)]
            if id(replica) in allowed and replica not in order:
                order.append(replica)
                if len(order) == len(allowed):
                    break
        return order + [r for r in eligible if r not in order]  # replicas unknown to the ring go last

    def owner(self, session_id: str, eligible: Sequence[Replica]) -> Replica:
        """The first eligible replica clockwise from the session's point."""
        return self.preference(session_id, eligible)[0]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def least_loaded(candidates: Sequence[Replica]) -> Replica:
    """Smallest load; ties go to the replica routed to least, then to flag order (round robin when idle)."""
    return min(candidates, key=lambda r: (r.load, r.requests_routed))


class RoutingPolicy(Protocol):
    name: str
    wants_page_keys: bool  # the router fills `request.page_keys` first
    keeps_sessions: bool  # a session has a home replica: the router migrates its KV when it moves

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision: ...


def _decision(replica: Replica, reason: str, previous: Replica | None, move_reason: str) -> RoutingDecision:
    moved = previous is not None and previous is not replica
    return RoutingDecision(replica, reason, previous if moved else None, move_reason if moved else None)


def _previous_move_reason(previous: Replica | None, candidates: Sequence[Replica]) -> str:
    return _gone_reason(previous) if previous is not None and previous not in candidates else "rebalance"


def _gone_reason(previous: Replica | None) -> str:
    """Why a session's replica is no candidate: drained by an operator, or down."""
    return "drained" if previous is not None and previous.draining and previous.healthy else "replica_down"


class QueueDepthPolicy:
    """Least loaded replica for every request (the baseline)."""

    name = "queue"
    wants_page_keys = False
    keeps_sessions = False

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision:
        previous = sessions.get(request.session_id)
        return _decision(least_loaded(candidates), "least_loaded", previous,
                         _previous_move_reason(previous, candidates))


class StickyPolicy:
    """A session stays on the replica of its latest turn while that replica is healthy. A new (or
    displaced) session goes to its parent session's replica when it names one (a subagent shares
    its parent's prefix), else to the least loaded replica, ties going to the first in the
    session's consistent-hash order (so idle routers agree, and equal loads place sessions the
    same way every run). A request without a session goes to the least loaded. With
    `max_imbalance`, a session whose replica holds that many more requests than the least loaded
    one is moved there (off by default)."""

    name = "sticky"
    wants_page_keys = False
    keeps_sessions = True

    def __init__(self, replicas: Sequence[Replica], max_imbalance: int | None = None) -> None:
        self.ring = HashRing(replicas)
        self.max_imbalance = max_imbalance

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision:
        if not request.session_id:
            return RoutingDecision(least_loaded(candidates), "no_session")
        previous = sessions.get(request.session_id)
        if previous is not None and previous in candidates:
            lightest = least_loaded(candidates)
            if self.max_imbalance is not None and previous.load - lightest.load > self.max_imbalance:
                return _decision(lightest, "imbalance", previous, "rebalance")
            return RoutingDecision(previous, "session")
        parent = sessions.get(request.parent_session_id)
        if previous is None and parent is not None and parent in candidates:
            return RoutingDecision(parent, "parent_session")
        order = self.ring.preference(request.session_id, candidates)
        placed = min(order, key=lambda r: (r.load, order.index(r)))
        return _decision(placed, "new_session" if previous is None else "moved", previous, _gone_reason(previous))


class PrefixPolicy:
    """The replica whose KV events show the most cached pages of this prompt, unless it holds
    `max_imbalance` more requests than the least loaded; with no hit anywhere, sticky."""

    name = "prefix"
    wants_page_keys = True
    keeps_sessions = False  # the next turn goes wherever its prefix is cached

    def __init__(self, replicas: Sequence[Replica], max_imbalance: int = 8) -> None:
        self.sticky = StickyPolicy(replicas)
        self.max_imbalance = max_imbalance

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision:
        keys = request.page_keys or []
        previous = sessions.get(request.session_id)
        scored = [(replica.prefix.cached_keys(keys), replica) for replica in candidates] if keys else []
        best_score = max((score for score, _ in scored), default=0)
        if best_score == 0:
            return self.sticky.choose(request, candidates, sessions)
        # among the best-scoring replicas: the session's own, else the least loaded
        best = [replica for score, replica in scored if score == best_score]
        chosen = previous if previous in best else least_loaded(best)
        lightest = least_loaded(candidates)
        if chosen.load - lightest.load > self.max_imbalance:
            return _decision(lightest, "imbalance", previous, "rebalance")
        return _decision(chosen, "prefix_hit", previous, _previous_move_reason(previous, candidates))


class PoolsPolicy:
    """First turns (fresh, long prefills) go to the least loaded prefill replica; later turns
    (mostly cached) stick to a decode replica by session. `--replica` URLs serve both pools; an
    empty pool falls back to every candidate. When a first turn ends, the router moves the session
    to its decode replica and has the pages prefetched there in the tool gap (`router/migration.py`),
    so its first later turn starts warm."""

    name = "pools"
    wants_page_keys = False
    keeps_sessions = True

    def __init__(self, replicas: Sequence[Replica]) -> None:
        first = [r for r in replicas if r.serves_first_turns()]
        later = [r for r in replicas if r.serves_later_turns()]
        if not first or not later or not any(r.role != "mixed" for r in replicas):
            raise RouterConfigError("--policy pools needs --prefill-replica URLs (first turns) and "
                                    "--decode-replica URLs (later turns); --replica URLs join both pools")
        self.sticky = StickyPolicy(later)

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision:
        previous = sessions.get(request.session_id)
        later = request.later_turn if request.later_turn is not None else previous is not None
        if not later:
            pool = [r for r in candidates if r.serves_first_turns()]
            if pool:
                return _decision(least_loaded(pool), "first_turn_pool", previous, "pool_switch")
        else:
            pool = [r for r in candidates if r.serves_later_turns()]
            if pool:
                decision = self.sticky.choose(request, pool, sessions)
                move_reason = decision.move_reason
                if decision.moved_from is not None and not decision.moved_from.serves_later_turns():
                    move_reason = "pool_switch"
                return RoutingDecision(decision.replica, "later_turn_pool", decision.moved_from, move_reason)
        return _decision(least_loaded(candidates), "pool_fallback", previous,
                         _previous_move_reason(previous, candidates))


class DisaggregatedPolicy:
    """Prefill/decode disaggregation. The decode replica is sticky by session among the
    `--decode-replica` URLs (`--replica` URLs join them). When the session is new to it (a first
    turn, a request without a session, a session that moved), the least loaded `--prefill-replica`
    computes the prompt's KV first and stores its pages in Mooncake, where the decode replica finds
    them by block hash (`prefill_on`). A later turn on the session's own decode replica goes there
    directly: its prefix is resident there and its new prefill is short. With no prefill replica
    left, or none whose Mooncake tier is in use, the decode replica serves the request whole."""

    name = "pd"
    wants_page_keys = False
    keeps_sessions = True

    def __init__(self, replicas: Sequence[Replica], max_imbalance: int | None = None) -> None:
        decode = [r for r in replicas if r.serves_later_turns()]
        if not decode or not any(r.role == "prefill" for r in replicas):
            raise RouterConfigError("--policy pd needs --prefill-replica URLs (prompts) and --decode-replica "
                                    "URLs (replies); --replica URLs join the decode pool")
        self.sticky = StickyPolicy(decode, max_imbalance)

    def choose(self, request: RoutingRequest, candidates: Sequence[Replica],
               sessions: SessionTable) -> RoutingDecision:
        decoders = [r for r in candidates if r.serves_later_turns()]
        if not decoders:  # only prefill replicas are left: one of them serves the request whole
            previous = sessions.get(request.session_id)
            return _decision(least_loaded(candidates), "pd_no_decode_replica", previous,
                             _previous_move_reason(previous, candidates))
        decision = self.sticky.choose(request, decoders, sessions)
        if decision.reason == "session":
            return RoutingDecision(decision.replica, "pd_decode_direct")
        prefillers = [r for r in candidates if r.role == "prefill"]
        usable = [r for r in prefillers if not r.shared_tier_degraded]
        fallback = None if usable else "mooncake_degraded" if prefillers else "no_prefill_replica"
        return RoutingDecision(decision.replica, "pd_disaggregated", decision.moved_from, decision.move_reason,
                               prefill_on=least_loaded(usable) if usable else None, pd_fallback=fallback)


POLICIES = ("sticky", "prefix", "pools", "pd", "queue")


def make_policy(name: str, replicas: Sequence[Replica], max_imbalance: int | None = None) -> RoutingPolicy:
    """A built-in policy by name (`POLICIES`)."""
    if name == "queue":
        return QueueDepthPolicy()
    if name == "sticky":
        return StickyPolicy(replicas, max_imbalance)
    if name == "prefix":
        return PrefixPolicy(replicas, 8 if max_imbalance is None else max_imbalance)
    if name == "pools":
        return PoolsPolicy(replicas)
    if name == "pd":
        return DisaggregatedPolicy(replicas, max_imbalance)
    raise RouterConfigError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
