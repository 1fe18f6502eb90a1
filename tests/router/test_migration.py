"""Session KV migration over fake replicas: when a turn ends and the session's next turn will go
elsewhere (a first turn's pool switch, a replica drained while the turn ran), the source flushes
its stores, the target prefetches the turn's prompt as the session, and the next turn goes to the
target; a tool gap the hints announce too short moves nothing early; failures are counted; the
queue baseline never migrates; the drain endpoints."""
from __future__ import annotations

import threading
import time

from starlette.testclient import TestClient

from agentjax.router.policies import make_policy
from agentjax.router.replicas import build_replicas
from agentjax.router.router import Router, create_router_app
from tests.router.fakes import FakeCluster
from tests.router.test_router import metric

CHAT = {"model": "m", "messages": [{"role": "system", "content": "tools"}, {"role": "user", "content": "hi"}]}
LATER = {"model": "m", "messages": [*CHAT["messages"], {"role": "assistant", "content": "ls"},
                                    {"role": "tool", "content": "a.py"}]}  # a later turn of the same session


def client_for(cluster: FakeCluster, policy: str, num_prefill: int = 0, **router_args) -> TestClient:
    if num_prefill:
        replicas = build_replicas([], cluster.urls[:num_prefill], cluster.urls[num_prefill:])
    else:
        replicas = build_replicas(cluster.urls)
    router = Router(replicas, make_policy(policy, replicas), health_interval_s=3600, transport=cluster.transport,
                    **router_args)
    return TestClient(create_router_app(router))


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_first_turns_pool_switch_prefetches_the_session_on_its_decode_replica_in_the_tool_gap():
    cluster = FakeCluster(3)
    prefill = cluster.replicas[0]
    body = {**CHAT, "agent_hints": {"expected_next_turn_s": 4.0}}
    with client_for(cluster, "pools", num_prefill=1) as client:
        first = client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "s",
                                                                        "Authorization": "Bearer k"})
        assert first.headers["x-agentjax-replica"] == prefill.url
        targets = [r for r in cluster.replicas[1:]]
        wait_until(lambda: any(r.kv_calls for r in targets))
        target = next(r for r in targets if r.kv_calls)
        wait_until(lambda: metric(client, "agentjax:router_kv_migrations_total", outcome="prefetched",
                                  reason="pool_switch") == 1)
        second = client.post("/v1/chat/completions", json=LATER, headers={"X-Session-ID": "s"})
        cached = metric(client, "agentjax:router_kv_migration_tokens_total", source="cached")
        computed = metric(client, "agentjax:router_kv_migration_tokens_total", source="computed")
        moves = metric(client, "agentjax:router_session_migrations_total", reason="pool_switch")
    assert [path for path, _, _ in prefill.kv_calls] == ["/kv/flush"]  # the source's stores reach Mooncake first
    (path, sent, headers), = target.kv_calls
    assert path == "/kv/prefill" and sent == {"path": "/v1/chat/completions", "body": body, "store": False,
                                              "session_id": "s"}
    assert headers["authorization"] == "Bearer k"
    assert second.headers["x-agentjax-replica"] == target.url and not target.received[1:]
    assert (cached, computed, moves) == (32, 8, 1)  # the fake's answer: 40 prompt tokens, 32 cached


def test_a_replica_drained_while_a_turn_runs_moves_that_session_with_its_kv_when_the_turn_ends():
    cluster = FakeCluster(2)
    with client_for(cluster, "sticky") as client:
        home_url = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"}).headers[
            "x-agentjax-replica"]
        home = cluster.by_url(home_url)
        other = next(r for r in cluster.replicas if r is not home)
        home.mode = "gated"
        replies = []
        turn = threading.Thread(target=lambda: replies.append(
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})))
        turn.start()
        wait_until(lambda: len(home.received) == 2)  # the turn is on its replica
        drained = client.post("/router/drain", json={"replica": home_url})
        assert drained.json() == {"replica": home_url, "draining": True, "sessions": 1}
        home.gate_open = True
        turn.join(10)
        assert replies[0].headers["x-agentjax-replica"] == home_url  # the turn in flight finishes there
        wait_until(lambda: metric(client, "agentjax:router_kv_migrations_total", outcome="prefetched",
                                  reason="drained") == 1)
        after = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        new_session = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "new"})
        health = {r["url"]: r["draining"] for r in client.get("/health").json()["replicas"]}
        client.post("/router/undrain", json={"replica": home_url})
        undrained = {r["url"]: r["draining"] for r in client.get("/health").json()["replicas"]}
    assert [path for path, _, _ in home.kv_calls] == ["/kv/flush"]
    assert [(path, body["session_id"]) for path, body, _ in other.kv_calls] == [("/kv/prefill", "s")]
    assert after.headers["x-agentjax-replica"] == other.url and after.headers["x-agentjax-route-reason"] == "session"
    assert new_session.headers["x-agentjax-replica"] == other.url  # a drained replica takes no new session
    assert health == {home_url: True, other.url: False} and not any(undrained.values())


def test_a_tool_gap_shorter_than_the_minimum_moves_the_session_only_at_its_next_turn():
    cluster = FakeCluster(2)
    body = {**CHAT, "agent_hints": {"expected_next_turn_s": 0.5}}
    with client_for(cluster, "pools", num_prefill=1, migration_min_gap_s=2.0) as client:
        client.post("/v1/chat/completions", json=body, headers={"X-Session-ID": "s"})
        wait_until(lambda: metric(client, "agentjax:router_kv_migrations_total", outcome="gap_too_short",
                                  reason="pool_switch") == 1)
        second = client.post("/v1/chat/completions", json={**LATER, "agent_hints": body["agent_hints"]},
                             headers={"X-Session-ID": "s"})
    assert not any(r.kv_calls for r in cluster.replicas)
    assert second.headers["x-agentjax-replica"] == cluster.replicas[1].url  # moved at the turn, recomputed there


def test_a_failed_prefetch_is_counted_and_the_session_still_moves():
    cluster = FakeCluster(2)
    cluster.replicas[1].kv_transfer_mode = "degraded"
    with client_for(cluster, "pools", num_prefill=1) as client:
        client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        wait_until(lambda: metric(client, "agentjax:router_kv_migrations_total", outcome="failed",
                                  reason="pool_switch") == 1)
        second = client.post("/v1/chat/completions", json=LATER, headers={"X-Session-ID": "s"})
    assert second.headers["x-agentjax-replica"] == cluster.replicas[1].url


def test_the_queue_baseline_never_migrates_and_drain_names_a_known_replica():
    cluster = FakeCluster(3)
    with client_for(cluster, "queue") as client:
        for _ in range(4):
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
        unknown = client.post("/router/drain", json={"replica": "http://127.0.0.1:1"})
        malformed = client.post("/router/drain", json={"url": "x"})
        time.sleep(0.1)
    assert not any(r.kv_calls for r in cluster.replicas)
    assert unknown.status_code == 404 and "the router has" in unknown.json()["error"]["message"]
    assert malformed.status_code == 400


def test_a_session_whose_replica_grew_overloaded_during_its_turn_is_rebalanced_in_the_tool_gap():
    cluster = FakeCluster(2)
    with client_for(cluster, "sticky") as client:
        router = client.app.state.router
        router.policy.max_imbalance = 2
        home_url = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"}).headers[
            "x-agentjax-replica"]
        home = cluster.by_url(home_url)
        home.mode = "gated"
        replies = []
        turn = threading.Thread(target=lambda: replies.append(
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})))
        turn.start()
        wait_until(lambda: len(home.received) == 2)
        home.in_server = 6  # other clients' requests pile up there while this turn runs
        client.portal.call(router.monitor.check_all)
        home.gate_open = True
        turn.join(10)
        wait_until(lambda: metric(client, "agentjax:router_kv_migrations_total", outcome="prefetched",
                                  reason="rebalance") == 1)
        after = client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": "s"})
    assert replies[0].headers["x-agentjax-replica"] == home_url
    assert after.headers["x-agentjax-replica"] != home_url and after.headers["x-agentjax-route-reason"] == "session"
