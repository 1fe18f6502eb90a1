"""Routing policies on plain replica state: sticky sessions, consistent hashing, queue depth, prefix
scores and first-turn / later-turn pools."""
from __future__ import annotations

import pytest

from agentjax.errors import RouterConfigError
from agentjax.router.policies import (
    HashRing,
    PoolsPolicy,
    PrefixPolicy,
    QueueDepthPolicy,
    SessionTable,
    StickyPolicy,
    make_policy,
)
from agentjax.router.replicas import build_replicas
from agentjax.router.routing_request import RoutingRequest


def chat(session_id: str | None = None, later_turn: bool | None = None, page_keys=None) -> RoutingRequest:
    return RoutingRequest("POST", "/v1/chat/completions", "chat", session_id=session_id, later_turn=later_turn,
                          page_keys=page_keys)


def route(policy, sessions: SessionTable, request: RoutingRequest, candidates):
    decision = policy.choose(request, candidates, sessions)
    sessions.record(request.session_id, decision.replica)
    return decision


def test_queue_depth_picks_the_least_loaded_and_round_robins_when_idle():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    policy, sessions = QueueDepthPolicy(), SessionTable()
    picked = []
    for _ in range(6):
        decision = route(policy, sessions, chat(), replicas)
        decision.replica.requests_routed += 1
        picked.append(decision.replica.url)
    assert picked == [r.url for r in replicas] * 2
    replicas[0].reported_in_server, replicas[1].in_flight = 5, 2
    assert policy.choose(chat(), replicas, sessions).replica is replicas[2]


def test_sticky_keeps_a_session_on_its_replica_whatever_the_load():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    policy, sessions = StickyPolicy(replicas), SessionTable()
    first = route(policy, sessions, chat("s1"), replicas)
    assert first.reason == "new_session"
    first.replica.in_flight = 50
    again = route(policy, sessions, chat("s1"), replicas)
    assert again.replica is first.replica and again.reason == "session" and again.moved_from is None


def test_new_sessions_spread_by_consistent_hash_and_a_lost_replica_moves_only_its_own():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    ring = HashRing(replicas)
    owners = {f"s{i}": ring.owner(f"s{i}", replicas) for i in range(300)}
    counts = {r.url: sum(o is r for o in owners.values()) for r in replicas}
    assert min(counts.values()) > 50, counts  # roughly even
    survivors = replicas[1:]
    for session, owner in owners.items():
        moved = ring.owner(session, survivors)
        assert moved is owner or owner is replicas[0]


def test_a_new_session_goes_to_the_least_loaded_replica_ties_in_consistent_hash_order():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    policy, sessions = StickyPolicy(replicas), SessionTable()
    owner = HashRing(replicas).owner("fresh", replicas)
    assert policy.choose(chat("fresh"), replicas, sessions).replica is owner  # all idle: the hash decides
    owner.in_flight = 1
    placed = policy.choose(chat("fresh"), replicas, sessions).replica
    assert placed is not owner and placed.load == 0


def test_a_subagent_starts_on_its_parent_sessions_replica():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    policy, sessions = StickyPolicy(replicas), SessionTable()
    parent = route(policy, sessions, chat("parent"), replicas).replica
    parent.in_flight = 5
    child = chat("child")
    child.parent_session_id = "parent"
    decision = route(policy, sessions, child, replicas)
    assert decision.replica is parent and decision.reason == "parent_session"


def test_a_session_whose_replica_is_down_moves_and_stays_where_it_moved():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    policy, sessions = StickyPolicy(replicas), SessionTable()
    home = route(policy, sessions, chat("s"), replicas).replica
    others = [r for r in replicas if r is not home]
    moved = route(policy, sessions, chat("s"), others)
    assert moved.reason == "moved" and moved.moved_from is home and moved.move_reason == "replica_down"
    back = route(policy, sessions, chat("s"), replicas)  # the old replica came back: the session stays
    assert back.replica is moved.replica and back.reason == "session"


def test_sticky_with_max_imbalance_moves_a_session_off_an_overloaded_replica():
    replicas = build_replicas([f"http://h:{i}" for i in range(2)])
    policy, sessions = StickyPolicy(replicas, max_imbalance=4), SessionTable()
    home = route(policy, sessions, chat("s"), replicas).replica
    home.in_flight = 4
    assert route(policy, sessions, chat("s"), replicas).replica is home
    home.in_flight = 5
    decision = route(policy, sessions, chat("s"), replicas)
    assert decision.replica is not home and decision.reason == "imbalance" and decision.move_reason == "rebalance"


def test_requests_without_a_session_go_to_the_least_loaded():
    replicas = build_replicas([f"http://h:{i}" for i in range(2)])
    replicas[0].in_flight = 3
    decision = StickyPolicy(replicas).choose(chat(None), replicas, SessionTable())
    assert decision.replica is replicas[1] and decision.reason == "no_session"


def test_prefix_picks_the_replica_with_the_longest_cached_prefix_unless_it_is_overloaded():
    replicas = build_replicas([f"http://h:{i}" for i in range(3)])
    replicas[0].prefix.cached = {"k1"}
    replicas[2].prefix.cached = {"k1", "k2", "k3"}
    policy, sessions = PrefixPolicy(replicas, max_imbalance=2), SessionTable()
    decision = policy.choose(chat("s", page_keys=["k1", "k2", "k3", "k4"]), replicas, sessions)
    assert decision.replica is replicas[2] and decision.reason == "prefix_hit"
    replicas[2].in_flight, replicas[0].in_flight = 3, 1
    decision = policy.choose(chat("s", page_keys=["k1", "k2", "k3", "k4"]), replicas, sessions)
    assert decision.replica is replicas[1] and decision.reason == "imbalance"
    miss = policy.choose(chat("s", page_keys=["x"]), replicas, sessions)
    assert miss.reason == "new_session"  # no hit anywhere: sticky


def test_prefix_breaks_a_tie_in_favour_of_the_sessions_own_replica():
    replicas = build_replicas([f"http://h:{i}" for i in range(2)])
    for replica in replicas:
        replica.prefix.cached = {"k1"}
    sessions = SessionTable()
    sessions.record("s", replicas[1])
    replicas[0].requests_routed, replicas[1].requests_routed = 0, 9
    decision = PrefixPolicy(replicas).choose(chat("s", page_keys=["k1"]), replicas, sessions)
    assert decision.replica is replicas[1] and decision.moved_from is None


def test_pools_send_first_turns_to_prefill_replicas_and_later_turns_to_sticky_decode_replicas():
    replicas = build_replicas([], prefill=["http://p:1", "http://p:2"], decode=["http://d:1", "http://d:2"])
    prefill, decode = replicas[:2], replicas[2:]
    policy, sessions = PoolsPolicy(replicas), SessionTable()
    first = route(policy, sessions, chat("s", later_turn=False), replicas)
    assert first.replica in prefill and first.reason == "first_turn_pool"
    second = route(policy, sessions, chat("s", later_turn=True), replicas)
    assert second.replica in decode and second.moved_from is first.replica and second.move_reason == "pool_switch"
    third = route(policy, sessions, chat("s", later_turn=None), replicas)  # known session: a later turn
    assert third.replica is second.replica and third.moved_from is None
    fallback = route(policy, sessions, chat("t", later_turn=True), prefill)  # every decode replica down
    assert fallback.replica in prefill and fallback.reason == "pool_fallback"


def test_policy_names_and_pool_flags_are_checked():
    replicas = build_replicas(["http://h:1"])
    assert {make_policy(name, replicas).name for name in ("sticky", "prefix", "queue")} == {"sticky", "prefix", "queue"}
    with pytest.raises(RouterConfigError, match="unknown routing policy 'random'"):
        make_policy("random", replicas)
    with pytest.raises(RouterConfigError, match="--prefill-replica"):
        make_policy("pools", replicas)
